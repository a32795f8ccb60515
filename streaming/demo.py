"""`make demo`: an hour of events -> stream (available-now) -> bounded twin -> summary."""

from __future__ import annotations

import time

from pyspark.sql import functions as F

from .durations import iso_ms
from .generator import GeneratorConfig, generate
from .jobs import get_job
from .runner import describe_watermark, run_stream
from .settings import Settings
from .session import get_spark
from .state import EngineState
from .tables import job_sinks

DEMO_FILES_PER_TRIGGER = 10


def run_demo(settings: Settings, cfg: GeneratorConfig) -> int:
    from batch.backfill import backfill

    started = time.monotonic()
    print(f"== 1/4 generating {cfg.duration} of events from {iso_ms(cfg.start)} into {settings.landing}", flush=True)
    reports = generate(cfg, settings.landing)
    pay = reports["payments"]
    print(f"   payments: {pay.events:,} events, {pay.late:,} very late, {pay.duplicates:,} re-delivered, "
          f"{pay.malformed:,} malformed, {len(pay.file_names)} files ({pay.files_skipped} already there)", flush=True)

    print("== 2/4 starting Spark (local, Iceberg catalog 'lake')", flush=True)
    job = get_job("purchase_metrics", settings)
    spark = get_spark(settings)

    if settings.job(job.name).max_files_per_trigger is None:
        # Several micro-batches, as a live stream would see them: the watermark advances between
        # them, so very late events are caught and sent to the side output.
        settings = settings.with_job(job.name, max_files_per_trigger=DEMO_FILES_PER_TRIGGER)
    print(f"== 3/4 streaming purchase_metrics until the landing zone is consumed (available-now, "
          f"{settings.job(job.name).max_files_per_trigger} files per micro-batch)", flush=True)
    stream = run_stream(spark, settings, job, available_now=True)
    record = EngineState(spark, settings.checkpoint_dir(job.name)).latest_record()
    totals = record.totals if record else stream.stats

    print(f"== 4/4 bounded twin over the same hour [{iso_ms(cfg.start)}, {iso_ms(cfg.start + cfg.duration)})", flush=True)
    # The demo's bounded twin overwrites what the stream wrote for the same hour (--force): windows
    # the stream has not closed yet are computed from all events and written too.
    bounded = backfill(spark, settings, job, cfg.start, cfg.start + cfg.duration, force=True)
    sinks = job_sinks(spark, settings, job)
    quarantine = sinks.quarantine["payments"]
    quarantined = quarantine.read().agg(F.coalesce(F.sum("occurrences"), F.lit(0))).first()[0]

    print()
    print("lakestream demo summary")
    print(f"  stream   : {totals.lines:,} lines read, {totals.events:,} events, {totals.duplicates:,} duplicates removed, "
          f"{totals.late:,} late events -> {job.late_sink.name}")
    print(f"             {totals.rows_written:,} closed windows written; watermark {describe_watermark(totals.watermark_out_ms)}"
          f" ({stream.batches} new batch(es) this run)")
    print(f"  bounded  : {bounded.stats.events:,} events, {bounded.stats.rows_written:,} windows "
          f"(every window, nothing late) in {bounded.seconds:.1f}s")
    print(f"  quarantine: {quarantined:,} records in {quarantine.table.name}; the stream sent {totals.late:,} late events aside")
    print(f"  tables   : {job.sink.name}, {job.late_sink.name}, {quarantine.table.name}")
    where = settings.warehouse if settings.format_of(job.name) == "iceberg" else settings.delta_root
    print(f"             {settings.format_of(job.name).capitalize()} tables under {where}")
    print(f"  checkpoint: {settings.checkpoint_dir(job.name)}")
    print("  Dagster UI: make ui  (then open http://127.0.0.1:3000)")
    print(f"  done in {time.monotonic() - started:.0f}s; re-running is safe")
    return 0
