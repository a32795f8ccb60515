"""Bounded twin of a job: the same declaration and engine over ``[start, end)`` of event time.

Bounded semantics (Flink's batch execution of a bounded stream): every file of the landing zone
is read (late arrivals sit in later files), events are kept when their window starts in the range,
nothing is late, and at end of input every window fires. The rows of the sink tables whose
``window_start`` lies in ``[start, end)`` are replaced atomically per table; running it again
yields the same rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime

from pyspark.sql import functions as F

from streaming import sinks
from streaming.declaration import WindowedJob
from streaming.durations import epoch_ms
from streaming.engine import BatchStats, plan_batch
from streaming.errors import DateRangeError
from streaming.hadoopfs import HadoopFS
from streaming.settings import Settings
from streaming.tables import ensure_job_tables


@dataclass(frozen=True)
class BackfillReport:
    job: str
    start: datetime
    end: datetime
    stats: BatchStats
    seconds: float

    @property
    def events_per_second(self) -> float:
        return self.stats.lines / self.seconds if self.seconds else 0.0


def check_range(start: datetime, end: datetime) -> None:
    if end <= start:
        raise DateRangeError(
            f"empty range: --end {end.isoformat()} is not after --start {start.isoformat()}; the range is [start, end)"
        )


def backfill(spark, settings: Settings, job: WindowedJob, start: datetime, end: datetime, *, progress=print) -> BackfillReport:
    check_range(start, end)
    started = time.monotonic()
    landing = settings.landing_dir(job.source.name)
    if not HadoopFS(spark).exists(landing):
        raise DateRangeError(f"no landing data at {landing}; run `lakestream generate` first or fix 'landing'")
    ensure_job_tables(spark, job)
    lo, hi = epoch_ms(start), epoch_ms(end)
    raw = spark.read.format("text").load(landing).select("value", F.col("_metadata.file_path").alias("source_file"))
    plan = plan_batch(job, raw, bounded=True, event_range_ms=(lo - job.window.span_ms, hi))
    try:
        stats = plan.stats()
        progress(f"{job.name}: backfill [{start.isoformat()}, {end.isoformat()}): read {stats.lines:,} lines, "
                 f"{stats.events:,} events in range")
        out = plan.finish(plan.next_watermark())
        in_range = (F.col("window_start") >= F.lit(start)) & (F.col("window_start") < F.lit(end))
        emitted = out.emitted.where(in_range)
        props = {"lakestream.job": job.name, "lakestream.backfill": f"{start.isoformat()}/{end.isoformat()}"}
        if stats.quarantined:
            sinks.merge_quarantine(plan.quarantine(), job.quarantine)
        sinks.replace_range(emitted, job.sink, lo, hi, job.keys, props)
        progress(f"{job.name}: replaced windows of {job.sink.name} in range")
        sinks.replace_range(plan.late().where(in_range), job.late_sink, lo, hi, (job.source.dedup_key,), props)
        written = spark.table(job.sink.name).where(in_range).count()
        stats = BatchStats(**{**stats.__dict__, "windows_written": written, "watermark_out_ms": plan.next_watermark()})
    finally:
        plan.release()
    return BackfillReport(job=job.name, start=start, end=end, stats=stats, seconds=time.monotonic() - started)
