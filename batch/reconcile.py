"""Reconciliation: does what the stream wrote agree with a bounded recomputation of the same range?

For every unit of output — a window (keys + ``window_start``) of a windowed job, a row of a keyed
job — the stream's table is compared with the bounded twin's result (computed, not written).
Every difference is classified:

* **late**: the late side output holds events that would change it (windows: a late row for that
  window, or for sessions a late event within a gap of it; keyed jobs: a late event of the key at
  or before the row's time) — the stream was right to leave them out;
* **in flight**: the window is not final in the stream yet (``end + lateness > watermark``; keyed:
  the row's time is past the watermark), or landing files the stream has not read yet hold events
  of it;
* **unexplained**: anything else — a bug, or a table changed behind the stream's back.

Per day the counts go to ``lake.ops.reconciliation`` (job, day, compared, matching, late, in
flight, unexplained, watermark, time) and are printed as a table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from functools import reduce

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from streaming.declaration import Job, KeyedJob, Table
from streaming.time import epoch_ms, from_epoch_ms, iso_ms
from streaming.errors import LakestreamError
from streaming.settings import Settings
from streaming.io.sinks import sink_for
from streaming.spark.columns import join_keys
from streaming.io.sources import kind_of, positions
from streaming.checkpoint.records import EngineState
from streaming.io.schemas import main_time_column
from streaming.io.tables import job_sinks

from .bounded import compute

RESULTS = Table("lake.ops.reconciliation")
RESULT_SCHEMA = T.StructType([
    T.StructField("job", T.StringType()),
    T.StructField("day", T.DateType()),
    T.StructField("range_start", T.TimestampType()),
    T.StructField("range_end", T.TimestampType()),
    T.StructField("compared", T.LongType()),
    T.StructField("matching", T.LongType()),
    T.StructField("late", T.LongType()),
    T.StructField("in_flight", T.LongType()),
    T.StructField("unexplained", T.LongType()),
    T.StructField("watermark_ms", T.LongType()),
    T.StructField("checked_at", T.TimestampType()),
])


class NothingToReconcileError(LakestreamError):
    """The job has never streamed."""


@dataclass(frozen=True)
class DayResult:
    day: date
    compared: int
    matching: int
    late: int
    in_flight: int
    unexplained: int


@dataclass
class ReconcileReport:
    job: str
    start: datetime
    end: datetime
    watermark_ms: int
    days: list[DayResult] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)  # a few unexplained differences
    seconds: float = 0.0
    unit: str = "windows"  # what a count counts: windows (keys + window_start), or a keyed job's output rows

    @property
    def unexplained(self) -> int:
        return sum(d.unexplained for d in self.days)

    def table(self) -> str:
        what = ("windows (keys + window start); late: windows that late events would change" if self.unit == "windows"
                else "output rows; late: rows at or after a late event of their key")
        head = f"{'day':10}  {'compared':>9}  {'matching':>9}  {'late':>6}  {'in flight':>9}  {'unexplained':>11}"
        lines = [f"counted in {what}", head, "-" * len(head)]
        for d in self.days:
            lines.append(f"{d.day.isoformat():10}  {d.compared:>9,}  {d.matching:>9,}  {d.late:>6,}  {d.in_flight:>9,}  "
                         f"{d.unexplained:>11,}")
        if not self.days:
            lines.append("(no output in the range, in the stream's tables or in the bounded result)")
        return "\n".join(lines)


def stream_watermark(spark, settings: Settings, job: Job) -> int:
    last = EngineState(spark, settings.checkpoint_dir(job.name)).latest_record()
    if last is None:
        raise NothingToReconcileError(
            f"{job.name} has never streamed (no checkpoint at {settings.checkpoint_dir(job.name)}); "
            f"run `lakestream run {job.name}` first"
        )
    return last.watermark_ms


def stream_positions(spark, settings: Settings, job: Job) -> dict[str, int]:
    """Where the stream's last committed batch left each source that has a position (e.g. the snapshot of a
    table source), by source name."""
    from streaming.checkpoint.layout import Layout, committed_offsets
    from streaming.spark.hadoopfs import HadoopFS

    return positions(job, committed_offsets(HadoopFS(spark), Layout(settings.checkpoint_dir(job.name))))


def reconcile(spark, settings: Settings, job: Job, start: datetime, end: datetime, *, progress=print,
              record: bool = True) -> ReconcileReport:
    """Recompute ``[start, end)`` with the bounded twin and compare the stream's tables with it."""
    say = progress or (lambda _m: None)
    watermark = stream_watermark(spark, settings, job)
    say(f"{job.name}: reconciling [{iso_ms(start)}, {iso_ms(end)}) against a bounded recomputation "
        f"(stream watermark {iso_ms(from_epoch_ms(watermark))})")
    started = time.monotonic()
    # Sources with a position (table sources: a snapshot) are read up to where the stream is, so records
    # appended since are not counted as differences (files: see _mark_unread_input).
    as_of = stream_positions(spark, settings, job)
    if as_of:
        by_name = {s.name: s for s in job.sources}
        say("  sources read up to where the stream is: "
            + ", ".join(f"{name} @ {kind_of(by_name[name]).describe_position(p)}" for name, p in as_of.items()))
    bounded = compute(spark, settings, job, epoch_ms(start), epoch_ms(end), say, as_of=as_of)
    try:
        report = compare(spark, settings, job, bounded, watermark, start, end)
    finally:
        bounded.release()
    report.seconds = time.monotonic() - started
    if record:
        record_results(spark, settings, report)
    return report


def compare(spark, settings: Settings, job: Job, bounded, watermark: int, start: datetime, end: datetime) -> ReconcileReport:
    """Compare the stream's tables over the range with an already computed bounded result."""
    from streaming.run.side import side_rows_committed

    lo, hi = epoch_ms(start), epoch_ms(end)
    side_rows_committed(spark, settings, job)  # (late rows the stream keeps in its checkpoint explain differences too)
    sinks = job_sinks(spark, settings, job)
    column = main_time_column(job)
    t = F.unix_millis(F.col(column))
    streamed = sinks.main.read().where((t >= lo) & (t < hi))
    late = sinks.late.read()
    units = (_keyed_units if isinstance(job, KeyedJob) else _window_units)(job, bounded.main, streamed, late, watermark)
    units = _mark_unread_input(spark, settings, job, units)
    units = units.cache()
    counts = units.groupBy("day").agg(
        F.count(F.lit(1)).alias("compared"),
        F.count(F.when(F.col("status") == "match", 1)).alias("matching"),
        F.count(F.when(F.col("status") == "late", 1)).alias("late"),
        F.count(F.when(F.col("status") == "in_flight", 1)).alias("in_flight"),
        F.count(F.when(F.col("status") == "unexplained", 1)).alias("unexplained"),
    ).orderBy("day").collect()
    examples = [r.what for r in units.where(F.col("status") == "unexplained").limit(5).collect()]
    units.unpersist()
    report = ReconcileReport(job.name, start, end, watermark, examples=examples,
                             unit="rows" if isinstance(job, KeyedJob) else "windows")
    report.days = [DayResult(r.day, r.compared, r.matching, r.late, r.in_flight, r.unexplained) for r in counts]
    return report


def record_results(spark, settings: Settings, report: ReconcileReport) -> None:
    sink = sink_for(spark, settings, RESULTS)
    sink.ensure(RESULT_SCHEMA, "day", "Stream/batch reconciliation results, one row per job, day and check")
    now = datetime.now(timezone.utc)
    rows = [(report.job, d.day, report.start, report.end, d.compared, d.matching, d.late, d.in_flight, d.unexplained,
             report.watermark_ms, now) for d in report.days]
    if rows:
        from streaming.io.sinks import Commit

        frame = spark.createDataFrame(rows, RESULT_SCHEMA)
        sink.append(frame, Commit(f"reconcile:{report.job}", int(now.timestamp() * 1000)), may_exist=False)


def unread_files(settings: Settings, job: Job) -> dict[str, list[str]]:
    """Landing files the stream has not read yet (from its checkpoint's source log), by source name."""
    from streaming.checkpoint.inspect import inspect_job
    from streaming.checkpoint.tree import landing_files

    folders = {s.name: folder for s in job.sources if (folder := kind_of(s).landing_folder(settings, s))}
    if not folders:
        return {}
    report = inspect_job(settings, job)
    if not report.files_waiting and not report.files_in_flight:
        return {}
    consumed = set(report.consumed_files)
    files = {}
    for name, folder in folders.items():
        try:
            files[name] = sorted(f"{folder.rstrip('/')}/{key.rsplit('/', 1)[-1]}"  # as Spark reads it
                                 for key in landing_files(folder, settings.storage_options) if key not in consumed)
        except (ValueError, OSError):  # the folder cannot be listed from Python: nothing to compare with
            return {}
    return {name: found for name, found in files.items() if found}


def _mark_unread_input(spark, settings: Settings, job: Job, units: DataFrame) -> DataFrame:
    """Differences in windows (keyed: rows of keys) with events in files the stream has not read are in flight."""
    files = unread_files(settings, job)
    if not files:
        return units
    from streaming.io.sources.base import union
    from streaming.io.parse import parse_sources
    from streaming.windowed.batch import plan_batch

    raw = union([kind_of(s).read(spark, settings, s, files=files[s.name]) for s in job.sources if s.name in files])
    if isinstance(job, KeyedJob):
        from streaming.spark.keyed import transformed_events

        events = transformed_events(job, parse_sources(job, raw))
        keys = [k for k in job.keys if k in units.columns]
        first = events.groupBy(*keys).agg(F.min(job.source.event_time).alias("_first_unread"))
        marked = join_keys(units, first, keys, "left").withColumn(
            "_unread", F.col("_first_unread").isNotNull() & (F.col("_first_unread") <= F.col("_time")))
    else:
        plan = plan_batch(job, raw, bounded=True)
        touched = plan.windowed().select(*job.keys, F.timestamp_millis("ws").alias("window_start"))
        marked = join_keys(units, touched.distinct().withColumn("_unread", F.lit(True)), [*job.keys, "window_start"], "left")
    return marked.withColumn("status", F.when((F.col("status") == "unexplained") & F.coalesce(F.col("_unread"), F.lit(False)),
                                              F.lit("in_flight")).otherwise(F.col("status")))


def _same(columns: list[str], approximate: frozenset[str] = frozenset()) -> F.Column:
    """Both sides hold the same values; floating-point columns within a relative 1e-9: a sum of doubles
    depends on the order it is added in, and a stream adds per micro-batch."""
    def same(c: str) -> F.Column:
        b, s = F.col(f"b_{c}"), F.col(f"s_{c}")
        if c not in approximate:
            return b.eqNullSafe(s)
        close = F.abs(b - s) <= F.lit(1e-9) * F.greatest(F.lit(1.0), F.abs(b), F.abs(s))
        return b.eqNullSafe(s) | F.coalesce(close, F.lit(False))
    return reduce(lambda a, b: a & b, [same(c) for c in columns], F.lit(True))


def _window_units(job, bounded: DataFrame, streamed: DataFrame, late: DataFrame, watermark: int) -> DataFrame:
    """One row per window of either side: day, status, and a description."""
    keys = [*job.keys, "window_start"]
    values = [c for c in bounded.columns if c not in keys]
    b = bounded.select(*keys, *[F.col(c).alias(f"b_{c}") for c in values], F.lit(True).alias("_b"))
    # A window is identified by its keys and start: a key the stream's table holds twice is a window written
    # twice, never a match (the duplicate's values are those of one of its rows).
    s = streamed.groupBy(*keys).agg(*[F.first(c).alias(f"s_{c}") for c in values], F.lit(True).alias("_s"),
                                    F.count(F.lit(1)).alias("_ns"))
    units = join_keys(b, s, keys, "full_outer")
    end = F.coalesce(F.col("b_window_end"), F.col("s_window_end"))
    floating = frozenset(f.name for f in bounded.schema.fields if isinstance(f.dataType, (T.DoubleType, T.FloatType)))
    twice = F.coalesce(F.col("_ns"), F.lit(0)) > 1
    matched = F.coalesce(F.col("_b"), F.lit(False)) & F.coalesce(F.col("_s"), F.lit(False)) & _same(values, floating) & ~twice
    hits = job.window.late_windows(units.withColumn("window_end", end), late, job.keys, job.source.event_time)
    units = join_keys(units, hits.withColumn("_late", F.lit(True)), keys, "left")
    lateness = job.watermark.allowed_lateness_ms
    in_flight = F.unix_millis(end) + F.lit(lateness) > F.lit(watermark)
    return units.select(
        *keys,
        F.to_date("window_start").alias("day"),
        F.when(matched, "match").when(twice, "unexplained").when(F.col("_late").isNotNull(), "late")
        .when(in_flight, "in_flight").otherwise("unexplained").alias("status"),
        F.concat_ws(" ", *[F.concat(F.lit(f"{k}="), F.col(k).cast("string")) for k in keys],
                    F.when(twice, F.concat(F.lit("written "), F.col("_ns").cast("string"), F.lit(" times by the stream")))
                    .when(F.col("_b").isNull(), F.lit("only in the stream"))
                    .when(F.col("_s").isNull(), F.lit("missing from the stream"))
                    .otherwise(F.lit("values differ"))).alias("what"),
    )


def _keyed_units(job: KeyedJob, bounded: DataFrame, streamed: DataFrame, late: DataFrame, watermark: int) -> DataFrame:
    """One row per distinct output row of either side (with multiplicities compared)."""
    columns = bounded.columns
    b = bounded.groupBy(*columns).agg(F.count(F.lit(1)).alias("_nb"))
    s = streamed.groupBy(*columns).agg(F.count(F.lit(1)).alias("_ns"))
    b = b.select(*[F.col(c).alias(f"b_{c}") for c in columns], "_nb")
    s = s.select(*[F.col(c).alias(f"s_{c}") for c in columns], "_ns")
    units = b.join(s, _same(columns), "full_outer")
    for c in columns:
        units = units.withColumn(c, F.coalesce(F.col(f"b_{c}"), F.col(f"s_{c}")))
    matched = F.coalesce(F.col("_nb"), F.lit(0)) == F.coalesce(F.col("_ns"), F.lit(0))
    # a row the stream wrote more often than the twin computes it (at least once) was written twice: never explained
    twice = F.coalesce(F.col("_ns"), F.lit(0)) > F.greatest(F.coalesce(F.col("_nb"), F.lit(0)), F.lit(1))
    keys = [k for k in job.keys if k in columns]
    if keys:  # a row is affected by the key's earliest late event and everything after it
        first_late = late.groupBy(*keys).agg(F.min(job.source.event_time).alias("_first_late"))
        units = join_keys(units, first_late, keys, "left").withColumn(
            "_late", F.when(F.col("_first_late") <= F.col(job.time_column), F.lit(True)))
    else:
        units = units.withColumn("_late", F.lit(None).cast("boolean"))
    in_flight = F.unix_millis(F.col(job.time_column)) > F.lit(watermark)
    return units.select(
        *keys,
        F.col(job.time_column).alias("_time"),
        F.to_date(job.time_column).alias("day"),
        F.when(matched, "match").when(twice, "unexplained").when(F.col("_late").isNotNull(), "late")
        .when(in_flight, "in_flight").otherwise("unexplained").alias("status"),
        F.concat_ws(" ", *[F.concat(F.lit(f"{k}="), F.col(k).cast("string")) for k in (*keys, job.time_column)],
                    F.when(twice, F.concat(F.lit("written "), F.col("_ns").cast("string"), F.lit(" times by the stream")))
                    .when(F.col("_nb").isNull(), F.lit("only in the stream"))
                    .when(F.col("_ns").isNull(), F.lit("missing from the stream"))
                    .otherwise(F.lit("count differs"))).alias("what"),
    )
