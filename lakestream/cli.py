"""`lakestream`: generate events, run jobs as streams or bounded twins, run the demo.

Every user error is one line on stderr and exit status 2 (set LAKESTREAM_DEBUG=1 for tracebacks).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from streaming.time import parse_duration, parse_instant
from streaming.errors import ConfigError, LakestreamError, translate_jvm_error
from streaming.settings import Settings


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + error
        self.exit(2, f"lakestream: error: {message} (see `{self.prog} --help`)\n")


def _settings(args) -> Settings:
    """The settings of this command, built once (``--home`` and ``--config`` over the environment)."""
    if getattr(args, "_settings", None) is None:
        args._settings = Settings.load(config_file=args.config, home=args.home)
    return args._settings


def cmd_init(args) -> int:
    from streaming.project import registry
    from streaming.spark.session import get_spark
    from streaming.io.tables import job_sinks

    settings = _settings(args)
    spark = get_spark(settings)
    jobs = list(registry(settings).values())
    for job in jobs:
        sinks = job_sinks(spark, settings, job)
        print(f"{job.name:22} " + ", ".join(f"{s.table.name}" for s in sinks.all()))
    where = settings.warehouse if settings.format == "iceberg" else settings.delta_root
    print(f"every job's tables exist ({settings.format} under {where})")
    try:  # (the UI then shows them as existing; a dbt mart over them builds without a missing-upstream warning)
        from orchestration.record import record_tables_created

        created = record_tables_created(jobs, what="lakestream init")
        if created:
            print(f"recorded in Dagster ({os.environ['DAGSTER_HOME']}): {len(created)} table(s) exist that no run had materialized")
    except Exception as exc:  # noqa: BLE001 - the tables exist whether or not Dagster hears of it
        print(f"(not recorded in Dagster: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    return 0


def cmd_jobs(args) -> int:
    from streaming.project import registry

    for name, job in registry(_settings(args)).items():
        what = job.window.describe() if job.kind == "windowed" else f"keyed {job.function.__name__}"
        sources = ",".join(s.name for s in job.sources)
        print(f"{name:22} {sources:16} {what:34} keys={','.join(job.keys):10} -> {job.sink.name}")
    return 0


def _generator_config(args):
    from .generator import GeneratorConfig

    return GeneratorConfig(
        seed=args.seed,
        start=parse_instant(args.start, field="--start"),
        duration=parse_duration(args.duration, field="--duration"),
        rate=args.rate,
        users=args.users,
        skew=args.skew,
        out_of_orderness=parse_duration(args.out_of_orderness, field="--out-of-orderness"),
        late_fraction=args.late_fraction,
        duplicate_fraction=args.duplicate_fraction,
        malformed_fraction=args.malformed_fraction,
        file_seconds=args.file_seconds,
    )


def cmd_new(args) -> int:
    from .scaffold import scaffold

    files = scaffold(args.folder, args.format, bare=args.bare)
    root = files[0].parent
    lakestream = _command()
    if args.bare:
        print(f"created {root} ({len(files)} files): sources.py, jobs/events_per_key.py, tests/, lakestream.yaml, "
              "definitions.py (a skeleton: give the source your fields, the job your keys and aggregates)")
        print(f"next:\n  cd {args.folder}\n  python -m pytest tests\n  {lakestream} --config lakestream.yaml run "
              "events_per_key --available-now")
        return 0
    print(f"created {root} ({len(files)} files): sources.py, jobs/events_per_user.py, generate.py, tests/, lakestream.yaml, "
          "definitions.py (README.md says which are examples and how to replace them)")
    print(f"next:\n  cd {args.folder}\n  {lakestream} --config lakestream.yaml generate && "
          f"{lakestream} --config lakestream.yaml run events_per_user --available-now\n  python -m pytest tests")
    return 0


def _command() -> str:
    """How to call lakestream from another folder: ``lakestream`` when the shell finds this one, else its path."""
    import shutil

    mine = os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else None
    found = shutil.which("lakestream")
    if mine and found and os.path.realpath(found) == mine:
        return "lakestream"
    return mine if mine and os.path.basename(mine) == "lakestream" else "lakestream"


def _project_generate(settings) -> int | None:
    """A user project's own sample data (its ``generate.generate(landing)``); None for the built-in project."""
    import importlib

    from streaming.io.sources import kind_of
    from streaming.project import current

    project = current(settings)
    if project.builtin:
        return None
    try:
        module = importlib.import_module(f"{project.package}.generate")
    except ModuleNotFoundError as exc:
        if exc.name != f"{project.package}.generate":
            raise
        raise ConfigError(f"project {project.name} has no generate.py with generate(landing); put its files into "
                          + ", ".join(kind_of(s).location(settings, s) for s in project.sources.values())) from None
    said = module.generate(settings.landing)
    print(f"sample data written under {settings.landing}" if said is None else said)
    return 0


def cmd_generate(args) -> int:
    from .generator import follow, generate

    settings = _settings(args)
    done = _project_generate(settings)
    if done is not None:
        return done
    cfg = _generator_config(args)
    if args.follow:
        print(f"generating in real time into {settings.landing} every {cfg.file_seconds}s; Ctrl-C to stop", flush=True)
        try:
            follow(cfg, settings.landing)
        except KeyboardInterrupt:
            pass
        return 0
    started = time.monotonic()
    for source, report in generate(cfg, settings.landing).items():
        print(
            f"{source}: {report.events:,} events ({report.late:,} late, {report.duplicates:,} re-delivered, "
            f"{report.malformed:,} malformed lines) in {len(report.file_names)} files "
            f"({report.files_skipped} already present"
            + (f", {report.files_renamed} under a new name: a file of that minute existed with other content"
               if report.files_renamed else "")
            + f") -> {settings.landing_dir(source)}"
        )
    print(f"generated in {time.monotonic() - started:.1f}s")
    return 0


def _job(args, settings):
    from streaming.project import get_job

    overrides = {}
    if getattr(args, "trigger_interval", None):
        overrides["trigger_interval"] = parse_duration(args.trigger_interval, field="--trigger-interval")
    if getattr(args, "max_files_per_trigger", None) is not None:
        if args.max_files_per_trigger < 1:
            raise ConfigError(f"--max-files-per-trigger must be at least 1, got {args.max_files_per_trigger}; "
                              "leave it out to read every waiting file in one micro-batch")
        overrides["max_files_per_trigger"] = args.max_files_per_trigger
    if overrides:
        settings = settings.with_job(args.job, **overrides)
    return get_job(args.job, settings), settings


def cmd_run(args) -> int:
    from streaming.declaration import late_count
    from streaming.run.runner import run_streams
    from streaming.time import describe_watermark
    from streaming.spark.session import get_spark

    names = list(dict.fromkeys(args.job))
    if args.flush and not args.available_now:
        raise ConfigError("--flush writes the windows still open when the input ends: use it with --available-now "
                          "(a continuous stream writes them as its watermark passes them)")
    if args.from_savepoint and len(names) > 1:
        raise ConfigError("--from-savepoint restores one job; run that job alone first (lakestream run JOB "
                          "--from-savepoint ID), then all of them together")
    settings = _settings(args)
    jobs = []
    for name in names:
        args.job = name
        job, settings = _job(args, settings)
        jobs.append(job)
    from streaming.checkpoint.lease import Lease
    from streaming.run.faults import pauses

    # Every job's lease before Spark starts: a second runner of a job is refused at once, in one line.
    leases = {}
    try:
        for job in jobs:
            lease = Lease(settings.checkpoint_dir(job.name), settings.storage_options, job=job.name)
            leases[job.name] = lease.acquire("restore" if args.from_savepoint else "stream")
        spark = get_spark(settings)
        if args.from_savepoint:  # restore and run under one lease: nothing starts the stream in between
            from streaming.checkpoint.savepoints import Savepoints

            Savepoints(spark, settings).restore(jobs[0], args.from_savepoint, lease=leases[jobs[0].name])
        reports = run_streams(spark, settings, jobs, available_now=args.available_now, fault=pauses(settings),
                              leases=leases)
    finally:
        for lease in leases.values():
            lease.release()
    flushed = {job.name: flush(spark, settings, job) for job in jobs} if args.flush else {}
    for job, report in zip(jobs, reports):
        s = report.stats
        print(
            f"{job.name}: {report.batches} batch(es): {s.lines:,} lines, {s.events:,} events, {late_count(job, s.late)}, "
            f"{s.quarantined:,} quarantined, {s.rows_written:,} rows written to {job.sink.name}; "
            f"watermark {describe_watermark(report.totals.watermark_out_ms if report.totals else None)}"
        )
        if job.name in flushed:
            print(f"{job.name}: {flushed[job.name]}")
        if report.step_seconds:  # where the batches' time went (inside foreachBatch, summed over the run)
            print(f"{job.name}: time per step: "
                  + ", ".join(f"{step} {seconds:.1f}s" for step, seconds in report.step_seconds.items()))
    return 0


def flush(spark, settings, job) -> str:
    """After an available-now run: write the windows the stream still holds open (Flink's end of bounded input:
    every window fires), as a backfill of the stopped stream's open range. The stream upserts those windows when
    it resumes, so a later run stays exactly-once. Keyed jobs' timers fire as their watermark passes them."""
    from batch.backfill import backfill, final_horizon_ms
    from streaming.checkpoint.records import EngineState
    from streaming.declaration import KeyedJob
    from streaming.time import from_epoch_ms, is_finite, iso_ms

    if isinstance(job, KeyedJob):
        return "nothing to flush (a keyed job's timers fire as its watermark passes them)"
    record = EngineState(spark, settings.checkpoint_dir(job.name)).latest_record()
    latest = record.totals.max_event_time_ms if record is not None else None
    horizon = final_horizon_ms(spark, settings, job)
    if latest is None or horizon is None:
        return "nothing to flush (no events yet)"
    lo, hi = horizon, latest + 1  # (the first window not yet final; no window starts after the last event)
    if not is_finite(lo) or lo >= hi:
        return "nothing to flush (every window is written)"
    report = backfill(spark, settings, job, from_epoch_ms(lo), from_epoch_ms(hi), progress=None)
    return (f"flushed the windows still open, starting in [{iso_ms(from_epoch_ms(lo))}, {iso_ms(from_epoch_ms(hi))}): "
            f"{report.stats.rows_written:,} row(s); a later run corrects them (upserts) as their events arrive")


def _range(args):
    from batch.backfill import check_range

    start = parse_instant(args.start, field="--start")
    end = parse_instant(args.end, field="--end")
    check_range(start, end)
    return start, end


def cmd_backfill(args) -> int:
    from batch.backfill import backfill
    from streaming.spark.session import get_spark

    settings = _settings(args)
    job, settings = _job(args, settings)
    start, end = _range(args)
    from streaming.errors import OwnershipError

    try:
        report = backfill(get_spark(settings), settings, job, start, end, force=args.force)
    except OwnershipError as exc:
        raise OwnershipError(f"{exc} (--force)") from None
    s = report.stats
    print(
        f"{job.name}: backfill done in {report.seconds:.1f}s ({report.events_per_second:,.0f} lines/s): "
        f"{s.events:,} events, {s.quarantined:,} quarantined, {s.rows_written:,} rows in range "
        f"({report.partitions} day partition(s) per table)"
    )
    return 0


def cmd_reconcile(args) -> int:
    from batch.reconcile import reconcile
    from streaming.spark.session import get_spark

    settings = _settings(args)
    job, settings = _job(args, settings)
    start, end = _range(args)
    report = reconcile(get_spark(settings), settings, job, start, end)
    print(report.table())
    for example in report.examples:
        print(f"  unexplained: {example}")
    verdict = "UNEXPLAINED differences" if report.unexplained else "every difference explained"
    print(f"{job.name}: {verdict} ({report.seconds:.1f}s); results appended to lake.ops.reconciliation")
    return 1 if report.unexplained else 0


def cmd_checkpoint_inspect(args) -> int:
    from streaming.checkpoint.health import job_thresholds
    from streaming.checkpoint.inspect import inspect_job
    from streaming.checkpoint.render import describe
    from streaming.project import get_job

    settings = _settings(args)
    job = get_job(args.job, settings)
    limits = job_thresholds(settings, job)
    if args.stall_factor is not None:
        if args.stall_factor <= 0:
            raise LakestreamError(f"--stall-factor must be positive, got {args.stall_factor}")
        limits.stall_factor = args.stall_factor
    report = inspect_job(settings, job, limits)
    print(report.to_json() if args.json else describe(report))
    return 1 if report.health.status == "error" else 0


def cmd_status(args) -> int:
    from streaming.checkpoint.inspect import inspect_job
    from streaming.checkpoint.render import status_table
    from streaming.project import registry

    settings = _settings(args)
    reports = [inspect_job(settings, job) for job in registry(settings).values()]
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=1))
    else:
        print(status_table(reports))
    return 1 if any(r.health.status == "error" for r in reports) else 0


def _describe_savepoint(sp) -> str:
    m = sp.manifest
    tables = ", ".join(f"{t}@{v if v is not None else 'empty'}" for t, v in m.get("tables", {}).items())
    return f"{sp.id}  batch {m.get('batch_id')}  {m.get('created')}  code {str(m.get('code_version'))[:10]}  {tables}"


def cmd_savepoint(args) -> int:
    from streaming.project import get_job
    from streaming.checkpoint.savepoints import Savepoints, job_of
    from streaming.spark.session import get_spark

    settings = _settings(args)
    action = args.savepoint_command
    job_name = args.job if action in ("create", "list") else job_of(args.id)
    job = get_job(job_name, settings)
    savepoints = Savepoints(get_spark(settings), settings)
    if action == "create":
        sp = savepoints.create(job, timeout_s=args.timeout, keep=args.keep)
        print(f"savepoint {sp.id} of {job.name} at batch {sp.manifest['batch_id']} -> {sp.path}")
        print(f"resume with: lakestream run {job.name} --from-savepoint {sp.id}")
    elif action == "list":
        found = savepoints.list(job.name)
        for sp in found:
            print(_describe_savepoint(sp))
        if not found:
            print(f"no savepoints of {job.name} in {savepoints.folder(job.name)}")
    elif action == "show":
        print(json.dumps(savepoints.get(args.id).manifest, indent=1))
    elif action == "delete":
        sp = savepoints.delete(args.id)
        print(f"deleted savepoint {sp.id}")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(_settings(args), _generator_config(args))


def _add_generator_options(p) -> None:
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--start", default="2026-11-20T00:00:00Z", help="event time of the first event (UTC)")
    p.add_argument("--duration", default="1h", help="span of event time, e.g. 10m, 1h, 1d")
    p.add_argument("--rate", type=float, default=100.0, help="payments per second of event time")
    p.add_argument("--users", type=int, default=500)
    p.add_argument("--skew", type=float, default=1.1, help="Zipf exponent of user activity")
    p.add_argument("--out-of-orderness", default="5s")
    p.add_argument("--late-fraction", type=float, default=0.005)
    p.add_argument("--duplicate-fraction", type=float, default=0.002)
    p.add_argument("--malformed-fraction", type=float, default=0.001)
    p.add_argument("--file-seconds", type=int, default=60, help="arrival time covered by one file")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lakestream", description=__doc__.splitlines()[0])
    parser.add_argument("--home", help="lakehouse root (default $LAKESTREAM_HOME or ./.lake)")
    parser.add_argument("--config", help="YAML settings file (default $LAKESTREAM_CONFIG)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    sub.add_parser("jobs", help="list the declared jobs").set_defaults(fn=cmd_jobs)
    sub.add_parser("init", help="create every job's tables (idempotent), e.g. before building the dbt marts"
                   ).set_defaults(fn=cmd_init)

    new = sub.add_parser("new", help="create a project of your own: a source, a job, sample data, a test")
    new.add_argument("folder", help="the new project's folder (its name is the package name)")
    new.add_argument("--format", default="csv", choices=("csv", "json"), help="the source's landing format")
    new.add_argument("--bare", action="store_true", help="one source and one job skeleton, without sample data")
    new.set_defaults(fn=cmd_new)

    gen = sub.add_parser("generate", help="write sample events to the landing zone (payments and logins, or "
                         "the project's own generate.py)")
    _add_generator_options(gen)
    gen.add_argument("--follow", action="store_true", help="keep producing in real time")
    gen.set_defaults(fn=cmd_generate)

    run = sub.add_parser("run", help="run jobs as streams (several: queries of one Spark application)")
    run.add_argument("job", nargs="+", help="one job, or several to run together")
    run.add_argument("--available-now", action="store_true", help="consume what exists, then stop")
    run.add_argument("--trigger-interval", help="micro-batch interval for continuous runs, e.g. 5s")
    run.add_argument("--max-files-per-trigger", type=int)
    run.add_argument("--flush", action="store_true",
                     help="with --available-now: at the end of input also write the windows still open (as Flink "
                          "does for bounded input); a later run corrects them as their events arrive")
    run.add_argument("--from-savepoint", metavar="ID", help="restore the checkpoint and roll the tables back to this savepoint first")
    run.set_defaults(fn=cmd_run)

    ranges = ("[start, end) selects rows by their time column: a windowed job's windows that START in it (each "
              "computed from all its events, those before start included), a keyed job's outputs by its time_column")
    bf = sub.add_parser("backfill", help="run a job's bounded twin over [start, end) and replace that range",
                        description=ranges)
    bf.add_argument("job")
    bf.add_argument("--start", required=True, help="inclusive, e.g. 2026-11-20 or 2026-11-20T13:00Z")
    bf.add_argument("--end", required=True, help="exclusive")
    bf.add_argument("--force", action="store_true",
                    help="also replace windows the stream has written but may still correct (past its watermark minus "
                         "lateness); windows it still holds open are left to a running stream, and written for a "
                         "stopped one, which then upserts them when it resumes")
    bf.set_defaults(fn=cmd_backfill)

    rc = sub.add_parser("reconcile", help="compare what the stream wrote over [start, end) with a bounded "
                        "recomputation; exit 1 when a difference is unexplained", description=ranges)
    rc.add_argument("job")
    rc.add_argument("--start", required=True, help="inclusive, e.g. 2026-11-20")
    rc.add_argument("--end", required=True, help="exclusive")
    rc.set_defaults(fn=cmd_reconcile)

    cp = sub.add_parser("checkpoint", help="look into a job's streaming checkpoint")
    cp_sub = cp.add_subparsers(dest="checkpoint_command", required=True, parser_class=_Parser)
    inspect = cp_sub.add_parser(
        "inspect",
        help="batches, source files, state, watermark and health, read without Spark "
        "(exit 1 when the health is error: stalled or corrupt)",
    )
    inspect.add_argument("job")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.add_argument("--stall-factor", type=float, help="stalled after this many trigger intervals without a commit while input waits (default 5)")
    inspect.set_defaults(fn=cmd_checkpoint_inspect)

    status = sub.add_parser("status", help="every job on one line: running or not, last batch, input waiting, "
                            "watermark, health (read without Spark; exit 1 when a job's health is error)")
    status.add_argument("--json", action="store_true", help="machine-readable output (the inspect report of each job)")
    status.set_defaults(fn=cmd_status)

    sp = sub.add_parser("savepoint", help="create, list, show and delete savepoints (stop-with-savepoint)")
    sp_sub = sp.add_subparsers(dest="savepoint_command", required=True, parser_class=_Parser)
    create = sp_sub.add_parser("create", help="stop the running job after its batch and save its progress and table versions")
    create.add_argument("job")
    create.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the running job to stop")
    create.add_argument("--keep", type=int, default=5, help="retention: keep the newest N savepoints of the job")
    create.set_defaults(fn=cmd_savepoint)
    listing = sp_sub.add_parser("list", help="the job's savepoints, oldest first")
    listing.add_argument("job")
    listing.set_defaults(fn=cmd_savepoint)
    for name, text in (("show", "a savepoint's manifest"), ("delete", "delete a savepoint")):
        p = sp_sub.add_parser(name, help=text)
        p.add_argument("id")
        p.set_defaults(fn=cmd_savepoint)

    demo = sub.add_parser("demo", help="generate an hour of events, stream it, backfill it, print a summary")
    _add_generator_options(demo)
    demo.set_defaults(fn=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except LakestreamError as exc:
        print(f"lakestream: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("lakestream: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `lakestream checkpoint inspect JOB | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # translate JVM errors at the boundary; keep real bugs visible
        if _debug(args):
            raise
        translated = translate_jvm_error(exc)
        if translated is None:
            raise
        print(f"lakestream: error: {translated} (LAKESTREAM_DEBUG=1 shows the trace)", file=sys.stderr)
        return translated.exit_code


def _debug(args) -> bool:
    """Whether to show whole traces (``LAKESTREAM_DEBUG``, through the command's settings; settings that do
    not load say why in one line of their own)."""
    try:
        return _settings(args).debug
    except Exception:  # noqa: BLE001 - settings that fail to load: their own error is the one to show
        return False


if __name__ == "__main__":
    sys.exit(main())
