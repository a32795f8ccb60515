"""`make demo`: an hour of events -> purchase_metrics as a stream (available-now) -> its bounded twin
over the same hour, compared with what the stream wrote -> a summary."""

from __future__ import annotations

import time

from pyspark.sql import functions as F

from streaming.time import describe_watermark, iso_ms
from .generator import GeneratorConfig, generate
from streaming.declaration import late_count
from streaming.project import registry
from streaming.run.runner import run_stream
from streaming.spark.session import get_spark
from streaming.settings import Settings
from streaming.checkpoint.records import EngineState
from streaming.io.tables import job_sinks

DEMO_FILES_PER_TRIGGER = 10


def run_demo(settings: Settings, cfg: GeneratorConfig) -> int:
    from dataclasses import replace

    from batch.reconcile import reconcile

    settings = replace(settings, project=None)  # the demo is the built-in example project's

    started = time.monotonic()
    print(f"== 1/4 generating {cfg.duration} of events from {iso_ms(cfg.start)} into {settings.landing}", flush=True)
    reports = generate(cfg, settings.landing)
    pay = reports["payments"]
    print(f"   payments: {pay.events:,} events, {pay.late:,} very late, {pay.duplicates:,} re-delivered, "
          f"{pay.malformed:,} malformed, {len(pay.file_names)} files ({pay.files_skipped} already there)", flush=True)

    print(f"== 2/4 starting Spark ({settings.spark_master}, {settings.format_of('purchase_metrics')} tables)", flush=True)
    jobs = registry(settings)  # resolved once
    job = jobs["purchase_metrics"]
    spark = get_spark(settings)
    for other in jobs.values():  # every table exists, so the dbt marts build on any lake
        job_sinks(spark, settings, other)
    if settings.job(job.name).max_files_per_trigger is None:
        # Several micro-batches, as a live stream would see them: the watermark advances between
        # them, so very late events are caught and sent to the side output.
        settings = settings.with_job(job.name, max_files_per_trigger=DEMO_FILES_PER_TRIGGER)
    print(f"== 3/4 streaming purchase_metrics until the landing zone is consumed (available-now, "
          f"{settings.job(job.name).max_files_per_trigger} files per micro-batch)", flush=True)
    stream = run_stream(spark, settings, job, available_now=True)
    record = EngineState(spark, settings.checkpoint_dir(job.name)).latest_record()
    totals = record.totals if record else stream.stats

    end = cfg.start + cfg.duration
    print(f"== 4/4 bounded twin over the same hour [{iso_ms(cfg.start)}, {iso_ms(end)}), compared with the stream",
          flush=True)
    check = reconcile(spark, settings, job, cfg.start, end, progress=None)
    sinks = job_sinks(spark, settings, job)
    quarantine = sinks.quarantine["payments"]
    quarantined = quarantine.read().agg(F.coalesce(F.sum("occurrences"), F.lit(0))).first()[0]
    day = check.days[0] if check.days else None

    recorded = _record_in_dagster(job, check, totals, list(jobs.values()))

    print()
    print("lakestream demo summary")
    print(f"  stream    : {totals.lines:,} lines read, {totals.events:,} events, {totals.duplicates:,} duplicates removed, "
          f"{late_count(job, totals.late)} -> {job.late_sink.name}")
    print(f"              {totals.rows_written:,} closed windows written; watermark {describe_watermark(totals.watermark_out_ms)}"
          f" ({stream.batches} new batch(es) this run)")
    if day is not None:
        print(f"  bounded   : {day.compared:,} windows recomputed from every event; {day.matching:,} equal the stream's, "
              f"{day.late:,} differ by late events (those in the side output), {day.in_flight:,} still open in the stream, "
              f"{day.unexplained:,} unexplained")
    print(f"  quarantine: {quarantined:,} lines in {quarantine.table.name}, each with its reason and file")
    print(f"  tables    : {job.sink.name}, {job.late_sink.name}, {quarantine.table.name}, lake.ops.reconciliation")
    where = settings.warehouse if settings.format_of(job.name) == "iceberg" else settings.delta_root
    print(f"              {settings.format_of(job.name).capitalize()} tables under {where}")
    print(f"  checkpoint: {settings.checkpoint_dir(job.name)}  (lakestream checkpoint inspect {job.name}; every job: lakestream status)")
    print("  next      : lakestream backfill purchase_metrics --start 2026-11-20 --end 2026-11-21 --force  "
          "(replace the hour with the bounded result)")
    print("  Dagster UI: make ui  (then open http://127.0.0.1:3000)"
          + (f"; this run is recorded there ({recorded})" if recorded else ""))
    print(f"  done in {time.monotonic() - started:.0f}s; re-running is safe")
    return 1 if check.unexplained else 0


def _record_in_dagster(job, check, totals, jobs) -> str | None:
    """The demo's stream and bounded twin as materializations in $DAGSTER_HOME's instance (the UI then
    shows the tables materialized), and the other jobs' tables it created as existing. Never fails the demo."""
    try:
        from orchestration.record import record_outside_run, record_tables_created

        days = [d.day.isoformat() for d in check.days]
        where = record_outside_run(job, days, what="lakestream demo: stream (available-now) + bounded twin comparison",
                                   metadata={"lines": totals.lines, "events": totals.events, "late_events": totals.late,
                                             "rows_written": totals.rows_written, "watermark_ms": totals.watermark_out_ms,
                                             "unexplained_differences": check.unexplained},
                                   reconciliation=check)
        record_tables_created(jobs, what="lakestream demo")
        return where
    except Exception as exc:  # noqa: BLE001 - the demo's result does not depend on Dagster
        print(f"   (not recorded in Dagster: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
        return None
