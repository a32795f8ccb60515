"""Streams as long-running Dagster runs: one job per streaming application (``<job>_stream``).

While a stream runs, each committed micro-batch becomes an ``AssetMaterialization`` of every
table and day partition it touched, with numeric metadata Dagster plots (rows in and written,
input and processing rate, batch duration, watermark and its lag, state rows, table version).
A run's event log slows down past a few thousand events, so the events of one table and
partition are merged over ``materialize_every_seconds`` (default 10; 0 logs every batch) and a
continuous run ends itself after ``rollover_after_seconds`` (default a day); the ``stream_supervisor``
sensor starts the next one from the checkpoint.

The ``streams`` job runs several jobs (run config ``jobs``, default all) as queries of one Spark
application: one JVM instead of one per job; terminating it, or a stop-with-savepoint of any of
its jobs, stops them all after their current batches.

A continuous run records that its streams *should be running* (``DesiredState``). Terminating
the run from the UI stops the queries after their current batch and records *stopped*; a run that
crashes leaves *running* behind, and the supervisor restarts it (an application as a whole).
"""


import enum
import json
import math
import os
import queue
import socket
import threading
import time
from datetime import timedelta
from typing import Optional

import dagster as dg
from dagster_pyspark import LazyPySparkResource
from pydantic import Field

from streaming.checkpoint.lease import pid_start_of
from streaming.declaration import Job, late_count
from streaming.run.commit import BatchResult
from streaming.run.runner import restore_signals, run_streams, take_signals
from streaming.time import describe_watermark, format_duration, is_finite, parse_duration
from streaming.io.tables import job_sinks

from .resources import LakestreamResource
from .tables import QUARANTINE_SHARE_MAX, STREAM_TAG, day_keys, stream_key, table_key

# The states of a run that holds (or is about to hold) its streams' checkpoints.
ACTIVE = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
          dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]


class Mode(enum.Enum):
    """available_now: consume what exists, then stop. continuous: run until terminated."""

    available_now = "available_now"
    continuous = "continuous"


class StreamConfig(dg.Config):
    """How to run the stream."""

    mode: Mode = Field(Mode.available_now, description="available_now: consume what exists, then stop; "
                       "continuous: run until terminated (the supervisor restarts it)")
    # Durations are numbers of seconds, as in Dagster's own settings: the launchpad checks a number's
    # type before a run starts (it cannot check the format of a text such as '5s').
    trigger_interval_seconds: Optional[float] = Field(
        None, description="seconds between micro-batches, e.g. 5 or 0.25 (empty: the job's setting, by default "
        "a batch as soon as input arrives and the last one has committed)")
    max_files_per_trigger: int = Field(0, description="landing files per micro-batch (0: the job's setting)")
    from_savepoint: str = ""  # a savepoint id: restore it (checkpoint and tables) before starting
    materialize_every_seconds: float = Field(10.0, description="merge a table partition's batches into one "
                                             "materialization per this many seconds (0: one per batch)")
    rollover_after_seconds: float = Field(86400.0, description="a continuous run ends itself after this many "
                                          "seconds (default a day); the supervisor starts the next one")


DURATION_FIELDS = ("trigger_interval_seconds", "materialize_every_seconds", "rollover_after_seconds")
_AS_TEXT = {"trigger_interval": "trigger_interval_seconds", "materialize_every": "materialize_every_seconds",
            "rollover_after": "rollover_after_seconds"}  # (as text, e.g. '5s', before they were seconds)


def durations_of(wanted: dict) -> dict:
    """A stream's duration settings as run config, from its desired state (written by the stream's last run;
    an instance written before they were numbers of seconds has them as text, e.g. '5s')."""
    config = {field: wanted[field] for field in DURATION_FIELDS if wanted.get(field) is not None}
    for text, field in _AS_TEXT.items():
        if field not in config and str(wanted.get(text) or "").strip():
            config[field] = parse_duration(wanted[text], field=text).total_seconds()
    return config


class DesiredState:
    """Whether a stream should be running, kept in the Dagster instance (so in its Postgres on a cluster)."""

    def __init__(self, instance: dg.DagsterInstance, job: str):
        self.storage = instance.daemon_cursor_storage
        self.key = f"lakestream/desired/{job}"

    def get(self) -> dict:
        raw = self.storage.get_cursor_values({self.key}).get(self.key)
        return json.loads(raw) if raw else {"state": "stopped"}

    def set(self, state: str, **info) -> None:
        self.storage.set_cursor_values({self.key: json.dumps({"state": state, "updated_ms": int(time.time() * 1000), **info})})


class MaterializationReporter:
    """Turns batch results (from Spark's batch thread) into merged materializations (main thread)."""

    def __init__(self, context: dg.OpExecutionContext, job: Job, versions, every_s: float, quarantine_sinks=None):
        self.context = context
        self.job = job
        self.versions = versions  # table name -> callable giving the table's current version
        # quarantine table name -> its sink: a batch that quarantines lines says which, and why, as a warning
        self.quarantine_sinks = dict(quarantine_sinks or {})
        self.every_s = every_s
        self.inbox: queue.Queue[BatchResult] = queue.Queue()
        self.pending: dict[tuple[str, str | None], dict] = {}
        self.last_flush = 0.0
        self.partitions_def = None
        # Lines read and quarantined since the quarantine tables' last commit: a windowed stream keeps quarantined
        # lines in its checkpoint between commits (streaming/run/side.py), and they are reported when committed.
        self.lines_since = 0
        self.quarantined_since = 0

    def on_batch(self, result: BatchResult) -> None:
        self.inbox.put(result)

    def tick(self, query) -> None:
        while True:
            try:
                result = self.inbox.get_nowait()
            except queue.Empty:
                break
            self._merge(result, query)
        if self.pending and time.monotonic() - self.last_flush >= self.every_s:
            self.flush()

    def _merge(self, result: BatchResult, query) -> None:
        s = result.stats
        progress = (query.lastProgress or {}) if query is not None else {}
        # what the stream remembers: the engine's store (windowed) or Spark's state operators (keyed)
        state_rows = result.state_rows if result.state_rows is not None else sum(
            op.get("numRowsTotal", 0) for op in progress.get("stateOperators", []))
        now_ms = int(time.time() * 1000)
        watermark = s.watermark_out_ms
        if result.outside_batch:
            self.context.log.info(
                f"{self.job.name}: committed the side rows kept through batch {result.batch_id} ("
                + ", ".join(f"{t}: {w.rows:,}" for t, w in result.tables.items()) + ")")
        else:
            self.context.log.info(
                f"{self.job.name} batch {result.batch_id}: {s.lines:,} lines, {s.events:,} events, "
                f"{late_count(self.job, s.late)}, {s.quarantined:,} quarantined, {s.rows_written:,} rows written in "
                f"{result.seconds:.2f}s; watermark {describe_watermark(watermark)}")
        if not result.outside_batch:
            self.lines_since += s.lines
            self.quarantined_since += s.quarantined
        wrote_quarantine = any(t in self.quarantine_sinks for t in result.tables)
        samples = self._quarantined(result, self.quarantined_since) if wrote_quarantine and self.quarantined_since else []
        for table, write in result.tables.items():
            days = day_keys(write.first_ms, write.last_ms, self.partitions_def) or [None]
            for day in days:
                entry = self.pending.setdefault((table, day), {"batches": [], "rows_written": 0, "rows_in": 0,
                                                               "seconds": 0.0, "late": 0, "quarantined": 0,
                                                               "samples": []})
                entry["batches"].append(result.batch_id)
                entry["rows_written"] += write.rows  # of the batch, over every partition it touched
                entry["seconds"] += result.seconds
                entry["late"] += s.late  # (summed over the merged batches, as the rows are)
                if table in self.quarantine_sinks:  # (the lines since its last commit, which this one brings)
                    entry["rows_in"] += self.lines_since
                    entry["quarantined"] += self.quarantined_since
                    entry["samples"] = (entry["samples"] + samples)[:5]
                else:
                    entry["rows_in"] += s.lines
                    entry["quarantined"] += s.quarantined
                entry.update(
                    watermark=watermark, state_rows=state_rows,
                    input_rate=float(progress.get("inputRowsPerSecond") or 0.0),  # (Spark has none for a first batch)
                    lag_s=max(0.0, (now_ms - watermark) / 1000) if is_finite(watermark) else 0.0,
                    complete=day is None or _day_complete(day, watermark),
                )
        if wrote_quarantine:
            self.lines_since = self.quarantined_since = 0

    def _quarantined(self, result: BatchResult, count: int) -> list[str]:
        """The quarantined lines the batch committed (``count``: since the last such commit), a few, as
        "<file>: <reason>", logged as a warning (a bad file in the landing zone is news, not a detail of an INFO
        line)."""
        found = []
        for table, sink in self.quarantine_sinks.items():
            if table not in result.tables:
                continue
            try:
                rows = sink.read().where(f"batch_id = {int(result.batch_id)} AND detected_by = '{self.job.name}'") \
                    .select("source_file", "reason", "occurrences").limit(5).collect()
            except Exception as exc:  # noqa: BLE001 - a report, never a reason to fail the stream
                self.context.log.warning(f"{self.job.name} batch {result.batch_id}: lines quarantined in {table} "
                                         f"(could not read them back: {type(exc).__name__})")
                continue
            for r in rows:
                name = (r.source_file or "?").rsplit("/", 1)[-1]
                found.append(f"{name}: {r.reason}" + (f" (x{r.occurrences})" if r.occurrences and r.occurrences > 1 else ""))
        if found:
            self.context.log.warning(
                f"{self.job.name} batch {result.batch_id}: {count:,} line(s) quarantined: "
                + "; ".join(found) + ("; ..." if count > len(found) else ""))
        return found

    def _quarantine_volume(self, table: str, day: str | None, e: dict, batches: str) -> dg.AssetCheckEvaluation:
        """The quarantine check, evaluated on the batches just reported (the check's own evaluation, from the
        asset's page or a schedule, covers everything the stream read)."""
        share = e["quarantined"] / e["rows_in"] if e["rows_in"] else 0.0
        where = f" ({day})" if day else ""
        return dg.AssetCheckEvaluation(
            asset_key=table_key(table), check_name="quarantine_volume", passed=share <= QUARANTINE_SHARE_MAX,
            severity=dg.AssetCheckSeverity.WARN,
            description=(f"{self.job.name} batches {batches}{where}: {e['quarantined']:,} of {e['rows_in']:,} lines "
                         f"quarantined ({share:.2%}; the limit is {QUARANTINE_SHARE_MAX:.0%})"
                         + (f"; e.g. {e['samples'][0]}" if e["samples"] else "")),
            metadata={"share_pct": round(share * 100, 3), "quarantined": e["quarantined"], "lines": e["rows_in"],
                      "job": self.job.name, "batches": batches})

    def flush(self) -> None:
        for (table, day), e in self.pending.items():
            version = self.versions[table]()
            batches = {"batches": f"{e['batches'][0]}..{e['batches'][-1]}", "batch_count": len(e["batches"]),
                       "table_version": str(version) if version is not None else "empty"}
            if table in self.quarantine_sinks:  # a quarantine table: its lines, and which files and why
                metadata = {**batches, "rows_written": e["rows_written"],  # (a row per distinct line of a file)
                            "examples": dg.MetadataValue.md("\n".join(f"- {x}" for x in e["samples"]) or "-")}
                self.context.log_event(dg.AssetMaterialization(
                    asset_key=table_key(table), partition=day, metadata=metadata,
                    description="; ".join(e["samples"][:2]) or None))
                self.context.log_event(self._quarantine_volume(table, day, e, batches["batches"]))
                continue
            metadata = {
                **batches, "rows_in": e["rows_in"], "rows_written": e["rows_written"], "late_events": e["late"],
                "quarantined_lines": e["quarantined"],
                "processed_rows_per_s": round(e["rows_in"] / e["seconds"], 1) if e["seconds"] else 0.0,
                "batch_seconds": round(e["seconds"] / len(e["batches"]), 2),
                "watermark": describe_watermark(e["watermark"]),
                "watermark_lag_s": round(e["lag_s"], 1), "state_rows": e["state_rows"],
                # a day the watermark has not passed yet is still being written: say so (Dagster shows it
                # materialized either way)
                "day_complete": e["complete"],
            }
            if e["input_rate"] > 0:  # (the rate input arrived at, as Spark measured it between triggers)
                metadata["input_rows_per_s"] = round(e["input_rate"], 1)
            if is_finite(e["watermark"]):
                metadata["watermark_time"] = dg.MetadataValue.timestamp(e["watermark"] / 1000)
            self.context.log_event(dg.AssetMaterialization(
                asset_key=table_key(table), partition=day, metadata=metadata,
                description=None if e["complete"] else f"partial day: the stream has reached "
                                                      f"{describe_watermark(e['watermark'])}"))
        if self.pending:
            # One unpartitioned observation of the stream per flush: its figures plot as time series on the
            # stream's asset (the tables' per-partition materializations plot one dot per day).
            latest = max(self.pending.values(), key=lambda e: e["batches"][-1])
            batches = sorted({b for e in self.pending.values() for b in e["batches"]})
            self.context.log_event(dg.AssetObservation(asset_key=stream_key(self.job), metadata={
                "last_batch": batches[-1], "batches": len(batches),
                "input_rows_per_s": round(latest["input_rate"], 1),
                "processed_rows_per_s": round(latest["rows_in"] / latest["seconds"], 1) if latest["seconds"] else 0.0,
                "batch_seconds": round(latest["seconds"] / len(latest["batches"]), 2),
                "watermark_lag_s": round(latest["lag_s"], 1), "state_rows": latest["state_rows"],
                "late_events": latest["late"], "quarantined_lines": latest["quarantined"],
            }))
        self.pending.clear()
        self.last_flush = time.monotonic()


def _day_complete(day: str, watermark_ms: int) -> bool:
    """Whether the watermark has passed the end of a day partition (``YYYY-MM-DD``)."""
    from datetime import datetime, timedelta, timezone

    try:
        end = datetime.fromisoformat(day).replace(tzinfo=timezone.utc) + timedelta(days=1)
    except ValueError:
        return True
    return watermark_ms >= end.timestamp() * 1000


APP_JOB = "streams"  # every job (or those chosen in run config) as one Spark application
APP_OP = "run_streams"


class StreamsConfig(dg.Config):
    """Which jobs to run together, as queries of one Spark application, and how."""

    jobs: list[str] = []  # empty: every job
    mode: Mode = Mode.available_now
    max_files_per_trigger: int = Field(0, description="landing files per micro-batch, each job (0: its setting)")
    trigger_interval_seconds: Optional[float] = Field(None, description="seconds between micro-batches, each job "
                                                      "(empty: its setting)")
    from_savepoints: dict[str, str] = {}  # job -> savepoint id to restore before starting
    materialize_every_seconds: float = Field(10.0, description="one materialization per table partition per this "
                                             "many seconds (0: one per batch)")
    rollover_after_seconds: float = Field(86400.0, description="a continuous run ends itself after this many seconds")


JOBS_TAG = "lakestream/jobs"  # the lakestream jobs a stream run runs, comma-separated


def jobs_of_run(run: dg.DagsterRun, all_jobs: list[str]) -> list[str]:
    """The lakestream jobs a stream run runs: its ``lakestream/jobs`` tag (every stream run has it: a job's own
    stream job carries it, an application's run gets it when it starts), else its run config."""
    tagged = run.tags.get(JOBS_TAG)
    if tagged:
        return tagged.split(",")
    if run.job_name == APP_JOB:
        config = (run.run_config or {}).get("ops", {}).get(APP_OP, {}).get("config", {})
        return list(config.get("jobs") or all_jobs)
    return []


RUNNING = [dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]
PROCESS_TAG = "lakestream/process"  # host:pid:start of the process that streams (see ``sensors.dead_run``)


def process_tags() -> dict[str, str]:
    """The tag that names this process: its host, pid and start time (so a reused pid is not taken for it)."""
    pid = os.getpid()
    return {PROCESS_TAG: f"{socket.gethostname()}:{pid}:{pid_start_of(pid) or ''}"}


def streaming_elsewhere(instance: dg.DagsterInstance, run_id: str, names: list[str]) -> str | None:
    """Why run ``run_id`` must not stream ``names``: an earlier run streams one of them already (the run
    queue keeps a second run of one stream job waiting; a job streamed alone and in an application are
    two tag values, so that overlap is refused here, before Spark starts), or None."""
    own = instance.get_run_record_by_id(run_id)
    since = own.create_timestamp if own is not None else None
    for job_name in (*[f"{n}_stream" for n in names], APP_JOB):
        for record in instance.get_run_records(dg.RunsFilter(job_name=job_name, statuses=RUNNING), limit=20):
            other = record.dagster_run
            shared = [n for n in jobs_of_run(other, names) if n in names]
            if other.run_id == run_id or not shared or (since is not None and record.create_timestamp >= since):
                continue
            return (f"{', '.join(shared)} already stream(s) in run {other.run_id} ({other.job_name}, "
                    f"{other.status.value.lower()} since {record.create_timestamp:%Y-%m-%d %H:%M:%S %Z}); a stream has "
                    "one runner: terminate that run first, or launch this one after it ends")
    return None


def _run_streams(context: dg.OpExecutionContext, declared: list[Job], config, from_savepoints: dict[str, str],
                 lakestream: LakestreamResource, pyspark: LazyPySparkResource, partitions_def) -> None:
    """What a stream run does, for one job or several (one query each, in one Spark application)."""
    for field in DURATION_FIELDS:
        value = getattr(config, field)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise dg.Failure(f"{field} must be a number of seconds, 0 or more, got {value}", allow_retries=False)
    if config.rollover_after_seconds == 0:
        raise dg.Failure("rollover_after_seconds must be more than 0 (default 86400, a day)", allow_retries=False)
    interval = None if config.trigger_interval_seconds is None else timedelta(seconds=config.trigger_interval_seconds)
    if config.max_files_per_trigger < 0:
        raise dg.Failure(f"max_files_per_trigger must be 1 or more (0: the job's setting), got {config.max_files_per_trigger}")
    settings = lakestream.settings()
    names = [job.name for job in declared]
    if context.run.tags.get(JOBS_TAG) != ",".join(names):
        context.instance.add_run_tags(context.run_id, {JOBS_TAG: ",".join(names)})
    refused = streaming_elsewhere(context.instance, context.run_id, names)
    if refused:
        raise dg.Failure(description=refused, allow_retries=False)
    context.instance.add_run_tags(context.run_id, process_tags())  # (the supervisor notices when it is gone)
    for name in names:
        extra = {"max_files_per_trigger": config.max_files_per_trigger} if config.max_files_per_trigger else {}
        if interval is not None:
            extra["trigger_interval"] = interval
        if extra:
            settings = settings.with_job(name, **extra)
    spark = lakestream.spark(pyspark)
    leases = {}  # a restore and the stream after it hold one lease: nothing starts the stream in between
    try:
        if from_savepoints:
            from streaming.checkpoint.savepoints import Savepoints

            savepoints = Savepoints(spark, settings, progress=context.log.info)
            for job in declared:
                if from_savepoints.get(job.name):
                    leases[job.name] = savepoints.lease(job).acquire("restore")
                    savepoints.restore(job, from_savepoints[job.name], lease=leases[job.name])
    except BaseException:
        for lease in leases.values():
            lease.release()
        raise
    continuous = config.mode == Mode.continuous
    application = names if len(names) > 1 else None
    if continuous:
        for name in names:
            DesiredState(context.instance, name).set(
                "running", run_id=context.run_id, mode=config.mode.value,
                **{field: getattr(config, field) for field in DURATION_FIELDS},
                max_files_per_trigger=config.max_files_per_trigger,
                **({"application": application} if application else {}))
    every_s = config.materialize_every_seconds
    reporters = {}
    for job in declared:
        sinks = job_sinks(spark, settings, job)
        reporters[job.name] = MaterializationReporter(context, job, {t.table.name: t.version for t in sinks.all()},
                                                      every_s, {q.table.name: q for q in sinks.quarantine.values()})
        reporters[job.name].partitions_def = partitions_def

    def flush_all() -> None:
        for reporter in reporters.values():
            reporter.flush()

    def stopped_on_request() -> None:
        for name in names:
            DesiredState(context.instance, name).set("stopped", reason="terminated", run_id=context.run_id)

    stop = threading.Event()
    rolled_over = threading.Event()  # (set with ``stop`` by the rollover; a savepoint's stop request sets ``stop`` alone)
    rolled = threading.Timer(config.rollover_after_seconds, lambda: (rolled_over.set(), stop.set()))
    if continuous:
        rolled.start()
    # Until the step returns, a termination is a stop request too: one that lands just after the queries stopped
    # for another reason (a savepoint asked them to, a rollover) is not an exception in the middle of the step's
    # last log lines.
    late_signals: list[str] = []
    outer = take_signals(late_signals, stop)
    try:
        # Dagster terminates a run with SIGINT (SIGTERM on a cluster). Taken as a stop request, it
        # never lands inside a Py4J call or an event-log write: the queries stop after their batch.
        # In an application, a stop request to one job (stop-with-savepoint) stops them all, so the
        # supervisor can start the application again from its savepoints.
        reports = run_streams(spark, settings, declared, available_now=not continuous,
                              progress=lambda result: reporters[result.job].on_batch(result),
                              stop_event=stop, install_signal_handlers=True,
                              tick=lambda query: reporters[query.name].tick(query), stop_together=True,
                              leases=leases)
    except BaseException:
        restore_signals(outer)
        if _terminating(context):  # interrupted before the stop request could be taken
            stopped_on_request()
            flush_all()
        raise
    finally:
        rolled.cancel()
    try:
        flush_all()
        signalled = next((r.signal for r in reports if r.signal), None) or next(iter(late_signals), None)
        if signalled is None and _terminating(context):  # terminated as the queries stopped: its signal is on its way
            deadline = time.monotonic() + 5
            while not late_signals and time.monotonic() < deadline:
                time.sleep(0.05)
            signalled = next(iter(late_signals), None)
        _end_streams(context, config, settings, declared, reports, signalled, continuous, stop, stopped_on_request,
                     rolled_over.is_set())
    finally:
        restore_signals(outer)


def _end_streams(context, config, settings, declared, reports, signalled, continuous, stop, stopped_on_request,
                 rolled_over: bool = False) -> None:
    batches = ", ".join(f"{r.job} after batch {r.last.batch_id if r.last else None}" for r in reports)
    if signalled is not None:  # terminated from the UI (or the process was asked to stop)
        if _terminating(context):
            # A stop on request is a clean end of the step (every batch committed): it ends without an
            # error, and Dagster's executor, which forwarded the termination to this step's process, ends
            # the run Canceled (the step is not shown failed, with no stack trace for a stop that went well).
            stopped_on_request()
            context.log.info(f"{signalled} received; stopped {batches}: terminated on request, every batch "
                             "committed (the run ends Canceled; the supervisor leaves it stopped)")
            return
        context.log.info(f"{signalled} received; stopped {batches}")
        raise dg.DagsterExecutionInterruptedError(f"interrupted ({signalled}); stopped {batches}")
    if continuous and rolled_over:
        context.log.info(f"rolled over after {format_duration(timedelta(seconds=config.rollover_after_seconds))}; "
                         "the supervisor starts the next run")
    elif continuous and stop.is_set():
        context.log.info("stopped on a stop request (a savepoint or a restore of one of its jobs); the supervisor "
                         "starts the next run once it is done")
    for report in reports:
        s = report.stats
        if report.totals is not None:
            watermark = report.totals.watermark_out_ms
        else:  # no batch this run: the checkpoint still holds the stream's watermark
            from streaming.checkpoint.inspect import inspect_job

            watermark = inspect_job(settings, next(j for j in declared if j.name == report.job)).watermark_ms
        context.log.info(f"{report.job}: {report.batches} batch(es), {s.lines:,} lines, {s.rows_written:,} rows "
                         f"written; watermark {describe_watermark(watermark)}")


def stream_job(job: Job, partitions_def) -> dg.JobDefinition:
    @dg.op(name=job.name, description=f"Run {job.name} as a stream.", tags={"kind": "spark"})
    def run(context: dg.OpExecutionContext, config: StreamConfig, lakestream: LakestreamResource,
            pyspark: LazyPySparkResource) -> None:
        _run_streams(context, [job], config, {job.name: config.from_savepoint} if config.from_savepoint else {},
                     lakestream, pyspark, partitions_def)

    @dg.job(name=f"{job.name}_stream", description=f"Stream {job.name} ({job.description})",
            tags={STREAM_TAG: job.name, JOBS_TAG: job.name})
    def stream():
        run()

    return stream


def streams_job(jobs: list[Job], partitions_def) -> dg.JobDefinition:
    known = [j.name for j in jobs]
    by_name = {j.name: j for j in jobs}

    @dg.op(name=APP_OP, description="Run the chosen jobs (config 'jobs', default all) as queries of one Spark "
                                     "application.", tags={"kind": "spark"})
    def run(context: dg.OpExecutionContext, config: StreamsConfig, lakestream: LakestreamResource,
            pyspark: LazyPySparkResource) -> None:
        unknown = [name for name in config.jobs if name not in known]
        if unknown:
            raise dg.Failure(f"unknown job(s) {', '.join(unknown)} in 'jobs'; known: {', '.join(known)}")
        names = list(dict.fromkeys(config.jobs)) or known
        stray = [name for name in config.from_savepoints if name not in names]
        if stray:
            raise dg.Failure(f"'from_savepoints' names {', '.join(stray)}, which this run does not run ({', '.join(names)})")
        _run_streams(context, [by_name[name] for name in names], config, config.from_savepoints, lakestream, pyspark,
                     partitions_def)

    @dg.job(name=APP_JOB, description="Stream several jobs in one Spark application (run config: jobs, mode, "
                                      "trigger_interval_seconds, from_savepoints)", tags={STREAM_TAG: APP_JOB})
    def streams():
        run()

    return streams


def _terminating(context: dg.OpExecutionContext) -> bool:
    """Whether this run is being terminated on request (rather than, say, its pod being evicted, after
    which the supervisor restarts it): Dagster marks the run CANCELING before it interrupts it."""
    run = context.instance.get_run_by_id(context.run_id)
    return run is not None and run.status in (dg.DagsterRunStatus.CANCELING, dg.DagsterRunStatus.CANCELED)

