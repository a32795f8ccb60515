"""Bounded twin of a job: the same declaration and engine over ``[start, end)`` of event time.

Bounded semantics (Flink's batch execution of a bounded stream): every file of the landing zone
is read (late arrivals sit in later files); nothing is late; at end of input every window and
every event-time timer fires. Windowed jobs compute the windows *starting* in the range (from the
events those windows need); keyed jobs replay ``history`` of event time before the range to
rebuild their state and keep the outputs whose time column lies in the range. The rows of every
sink table (main, late side output) in ``[start, end)`` are replaced atomically, one commit per
table, Iceberg and Delta alike; quarantined lines are added unless already present. Running it
again gives the same rows.

**Who owns which partitions.** The live stream owns every window it may still write: those not
yet final under its watermark ``W`` and allowed lateness ``L``. A backfill refuses a range that
reaches past the stream's *final horizon* unless ``force=True`` (then the stream's later writes to
those windows win, or duplicate them if it appends):

* tumbling/sliding windows: the range must end by ``W - L - size + every`` (every window starting
  before the end has ``end + L <= W``);
* sessions: as above with the gap, and no session open in the stream's state may start before
  the end of the range;
* keyed jobs: the range must end by ``W`` (later outputs come from later elements and timers).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Callable

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from streaming.declaration import Job, KeyedJob, WindowedJob
from streaming.durations import epoch_ms, from_epoch_ms, iso_ms
from streaming.engine import SOURCE, BatchStats, plan_batch
from streaming.errors import DateRangeError, OwnershipError
from streaming.hadoopfs import HadoopFS
from streaming.settings import Settings
from streaming.state import EngineState
from streaming.tables import JobSinks, job_sinks, late_time_column, main_time_column
from streaming.windows import Session

DAY_MS = 86_400_000


@dataclass(frozen=True)
class BackfillReport:
    job: str
    start: datetime
    end: datetime
    stats: BatchStats
    seconds: float
    partitions: int  # day partitions replaced per table

    @property
    def events_per_second(self) -> float:
        return self.stats.lines / self.seconds if self.seconds else 0.0


def check_range(start: datetime, end: datetime) -> None:
    if end <= start:
        raise DateRangeError(
            f"empty range: --end {end.isoformat()} is not after --start {start.isoformat()}; the range is [start, end)"
        )


def read_landing(spark, settings: Settings, job: Job) -> DataFrame:
    """Every line of every source folder of ``job``, as a batch: value, source_file, _source."""
    fs = HadoopFS(spark)
    frames = []
    for source in job.sources:
        landing = settings.landing_dir(source.name)
        if not fs.exists(landing):
            raise DateRangeError(f"no landing data at {landing}; run `lakestream generate` first or fix 'landing'")
        frames.append(spark.read.format("text").load(landing).select(
            "value", F.col("_metadata.file_path").alias("source_file"), F.lit(source.name).alias(SOURCE)
        ))
    raw = frames[0]
    for frame in frames[1:]:
        raw = raw.unionByName(frame)
    return raw


def final_horizon_ms(spark, settings: Settings, job: Job) -> int | None:
    """The event time before which the live stream will write nothing more (None: no stream yet)."""
    state = EngineState(spark, settings.checkpoint_dir(job.name))
    record = state.latest_record()
    if record is None:
        return None
    w = record.watermark_ms
    if isinstance(job, KeyedJob):
        return w
    lateness = job.watermark.allowed_lateness_ms
    window = job.window
    if isinstance(window, Session):
        horizon = w - lateness - window.gap_ms
        loaded = state.load_before(record.batch_id + 1)
        if loaded.open_windows is not None:
            first = loaded.open_windows.agg(F.min("window_start_ms")).first()[0]
            if first is not None:
                horizon = min(horizon, first)
        return horizon
    return w - lateness - window.size_ms + window.every_ms


def check_ownership(spark, settings: Settings, job: Job, end_ms: int, force: bool, say: Callable[[str], None]) -> None:
    horizon = final_horizon_ms(spark, settings, job)
    if horizon is None or end_ms <= horizon:
        return
    where = iso_ms(from_epoch_ms(horizon)) if horizon > -(2**61) else "the beginning (no window is final yet)"
    if force:
        say(f"{job.name}: --force: the range ends after {where}, where the live stream's windows are final; "
            "the stream may still write (and win) there")
        return
    raise OwnershipError(
        f"{job.name}: the range ends at {iso_ms(from_epoch_ms(end_ms))}, but the live stream may still write windows "
        f"after {where} (its watermark minus allowed lateness); backfill an earlier range, wait for the stream, "
        "or pass --force to overwrite anyway"
    )


def _days(lo_ms: int, hi_ms: int) -> int:
    return len(range(lo_ms - lo_ms % DAY_MS, hi_ms, DAY_MS))


def backfill(spark, settings: Settings, job: Job, start: datetime, end: datetime, *,
             progress: Callable[[str], None] | None = print, force: bool = False) -> BackfillReport:
    """Recompute ``job`` over ``[start, end)`` and replace that range in every sink table."""
    say = progress or (lambda _m: None)
    check_range(start, end)
    lo, hi = epoch_ms(start), epoch_ms(end)
    check_ownership(spark, settings, job, hi, force, say)
    started = time.monotonic()
    sinks = job_sinks(spark, settings, job)
    raw = read_landing(spark, settings, job)
    days = _days(lo, hi)
    say(f"{job.name}: backfill [{iso_ms(start)}, {iso_ms(end)}): {days} day partition(s) x "
        f"{2 + len(job.sources)} table(s)")
    if isinstance(job, KeyedJob):
        stats = _keyed(spark, job, raw, lo, hi, sinks, say, started)
    else:
        stats = _windowed(job, raw, lo, hi, sinks, say, started)
    return BackfillReport(job=job.name, start=start, end=end, stats=stats, seconds=time.monotonic() - started,
                          partitions=days)


def _props(job: Job, lo: int, hi: int) -> dict[str, str]:
    return {"lakestream.job": job.name, "lakestream.backfill": f"{iso_ms(from_epoch_ms(lo))}/{iso_ms(from_epoch_ms(hi))}"}


def _replace(sinks: JobSinks, job: Job, main: DataFrame, late: DataFrame, quarantine: dict[str, DataFrame],
             lo: int, hi: int, say) -> int:
    props = _props(job, lo, hi)
    for source, frame in quarantine.items():
        sinks.quarantine[source].insert_missing(frame, ("source_file", "raw_line"), props)
    sinks.late.replace_range(late, late_time_column(job), lo, hi, props)
    say(f"  {sinks.late.table.name}: range replaced ({_days(lo, hi)} day partition(s); nothing is late in a bounded run)")
    main = main.cache()
    rows = main.count()
    sinks.main.replace_range(main, main_time_column(job), lo, hi, props)
    say(f"  {sinks.main.table.name}: range replaced ({_days(lo, hi)} day partition(s), {rows:,} rows)")
    main.unpersist()
    return rows


def _windowed(job: WindowedJob, raw: DataFrame, lo: int, hi: int, sinks: JobSinks, say, started: float) -> BatchStats:
    plan = plan_batch(job, raw, bounded=True, event_range_ms=job.window.events_for(lo, hi))
    try:
        stats = plan.stats()
        seconds = time.monotonic() - started
        say(f"  read {stats.lines:,} lines ({stats.lines / max(seconds, 1e-9):,.0f} lines/s), {stats.events:,} events "
            f"for the range, {stats.quarantined:,} quarantined")
        out = plan.finish(plan.next_watermark())
        in_range = (F.col("window_start") >= F.lit(from_epoch_ms(lo))) & (F.col("window_start") < F.lit(from_epoch_ms(hi)))
        quarantine = {s.name: plan.quarantine(s.name) for s in job.sources if plan.quarantined_by_source.get(s.name)}
        rows = _replace(sinks, job, out.written.where(in_range), plan.late(), quarantine, lo, hi, say)
        return BatchStats(**{**stats.__dict__, "rows_written": rows, "watermark_out_ms": plan.next_watermark()})
    finally:
        plan.release()


def _keyed(spark, job: KeyedJob, raw: DataFrame, lo: int, hi: int, sinks: JobSinks, say, started: float) -> BatchStats:
    from streaming.engine import POS_INF_MS, parse_sources
    from streaming.keyed.spark import bounded_frame, schemas, split

    parsed = parse_sources(job, raw)
    t_ms = F.unix_millis(F.col(job.source.event_time))
    first = lo - int(job.history / timedelta(milliseconds=1))
    parsed = parsed.where(F.col("_reason").isNotNull() | ((t_ms >= first) & (t_ms < hi)))
    frame = bounded_frame(job, parsed).cache()
    try:
        row = frame.agg(
            F.count(F.when(F.col("_kind") == "q", 1)).alias("bad"),
            F.coalesce(F.sum("_s_in"), F.lit(0)).alias("inputs"),
            F.coalesce(F.sum("_s_dup"), F.lit(0)).alias("dups"),
            F.max("_s_max_t").alias("max_t"),
        ).first()
        seconds = time.monotonic() - started
        lines = row["inputs"] + row["bad"]
        say(f"  ran the keyed function over {row['inputs']:,} events ({lines / max(seconds, 1e-9):,.0f} events/s), "
            f"{row['bad']:,} quarantined")
        main_schema, _ = schemas(spark, job)
        parts = split(job, frame, main_schema)
        column = F.unix_millis(F.col(job.time_column))
        main = parts["main"].where((column >= lo) & (column < hi))
        quarantine = {s.name: parts[f"quarantine:{s.name}"] for s in job.sources}
        rows = _replace(sinks, job, main, parts["late"], quarantine, lo, hi, say)
        return BatchStats(lines=lines, quarantined=row["bad"], events=row["inputs"] - row["dups"],
                          duplicates=row["dups"], rows_written=rows, max_event_time_ms=row["max_t"],
                          watermark_out_ms=POS_INF_MS)
    finally:
        frame.unpersist()
