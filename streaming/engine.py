"""The event-time engine of windowed jobs: one micro-batch (or one bounded run).

The same code serves the stream (inside ``foreachBatch``, with state carried between batches)
and the bounded twin (one call, empty state, perfect watermark). It only builds DataFrames and
runs the small actions of the batch statistics; the runners do the I/O.

Per batch, with ``W_in`` the watermark at the start of the batch and ``L`` the allowed lateness
(see ``declaration`` for the rules):

1. parse lines of every source; invalid ones become quarantine rows (per file and line text);
2. drop duplicate deliveries (dedup key) within the batch and against the keys seen in earlier
   batches (kept until ``max(event_time, W_in) + dedup_ttl <= W``);
3. transform the events and assign windows (a sliding window event yields one row per window;
   a session event opens ``[t, t + gap)``); a (row, window) with ``end + L <= W_in`` is late and
   goes to the late side output with the original event; the rest are measured;
4. merge them with the open windows of earlier batches in one aggregation (sessions: per key,
   windows that overlap or touch merge, gaps-and-islands over start/end);
5. ``W_out = max(W_in, max event time of the batch - out_of_orderness)`` (bounded: +infinity);
   windows with ``end <= W_out`` that are new or changed fire. Without lateness each fires once
   (append). With lateness a window stays open until ``end + L <= W_out``; a changed window is
   written again (upsert on keys + ``window_start``), and the rows of sessions it absorbed, or
   of windows that no longer satisfy ``having``, are deleted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from .declaration import Agg, WindowedJob
from .errors import DeclarationError
from .parse import parse
from .sinks.base import OP
from .windows import Session, Sliding

NEG_INF_MS = -(2**62)
POS_INF_MS = 2**62
WS, WE = "window_start_ms", "window_end_ms"
SOURCE = "_source"  # raw frames of multi-source jobs say which source a line came from


@dataclass(frozen=True)
class BatchStats:
    """What one micro-batch (or bounded run) did; all counts are exact."""

    lines: int = 0
    quarantined: int = 0
    events: int = 0  # valid, deduplicated events (on time + late)
    duplicates: int = 0
    late: int = 0  # rows of the late side output (windowed: one per event and missed window)
    rows_written: int = 0  # main-table rows written (windows, keyed outputs)
    rows_deleted: int = 0  # main-table rows deleted (retracted sessions, windows that left ``having``)
    max_event_time_ms: int | None = None
    watermark_in_ms: int = NEG_INF_MS
    watermark_out_ms: int = NEG_INF_MS

    def plus(self, other: "BatchStats") -> "BatchStats":
        def mx(a, b):
            return b if a is None else a if b is None else max(a, b)

        return BatchStats(
            lines=self.lines + other.lines,
            quarantined=self.quarantined + other.quarantined,
            events=self.events + other.events,
            duplicates=self.duplicates + other.duplicates,
            late=self.late + other.late,
            rows_written=self.rows_written + other.rows_written,
            rows_deleted=self.rows_deleted + other.rows_deleted,
            max_event_time_ms=mx(self.max_event_time_ms, other.max_event_time_ms),
            watermark_in_ms=min(self.watermark_in_ms, other.watermark_in_ms),
            watermark_out_ms=max(self.watermark_out_ms, other.watermark_out_ms),
        )


def _agg_expr(kind: str, column: str) -> Column:
    if kind == "count":
        return F.count(F.lit(1)) if column == "*" else F.sum(column)
    return {"sum": F.sum, "min": F.min, "max": F.max}[kind](column)


def aggregate_type(agg: Agg, schema: T.StructType) -> T.DataType:
    """The fixed type of an aggregate, so state and sink keep one schema across batches."""
    if agg.kind == "count":
        return T.LongType()
    source = schema[agg.column].dataType
    if agg.kind in ("min", "max"):
        return source
    if isinstance(source, T.DecimalType):
        return T.DecimalType(38, source.scale)
    if isinstance(source, (T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.BooleanType)):
        return T.LongType()
    return T.DoubleType()


def assign_windows(frame: DataFrame, job: WindowedJob, time_ms: Column) -> DataFrame:
    """Add ``window_start_ms``/``window_end_ms``: the half-open windows ``[start, end)`` of each row."""
    window = job.window
    if isinstance(window, Session):
        return frame.withColumn(WS, time_ms).withColumn(WE, time_ms + F.lit(window.gap_ms))
    size, every = window.size_ms, window.every_ms
    last = time_ms - F.pmod(time_ms, F.lit(every))
    if isinstance(window, Sliding) and window.windows_per_event > 1:
        frame = frame.withColumn("_back", F.explode(F.sequence(F.lit(0), F.lit(window.windows_per_event - 1))))
        frame = frame.withColumn(WS, last - F.col("_back") * F.lit(every)).drop("_back")
        frame = frame.where(F.col(WS) + F.lit(size) > time_ms)
    else:
        frame = frame.withColumn(WS, last)
    return frame.withColumn(WE, F.col(WS) + F.lit(size))


@dataclass
class BatchPlan:
    """The lazily built frames of one batch. Call :meth:`stats` once, then :meth:`finish`."""

    job: WindowedJob
    watermark_in_ms: int
    bounded: bool
    parsed: DataFrame  # every line of every source: fields, source, source_file, _raw, _reason
    open_windows: DataFrame | None
    seen_keys: DataFrame | None
    event_range_ms: tuple[int, int] | None = None
    _events: DataFrame | None = None
    _windowed: DataFrame | None = None
    _late: DataFrame | None = None
    _cached: list[DataFrame] = field(default_factory=list)
    _stats: BatchStats | None = None
    quarantined_by_source: dict[str, int] = field(default_factory=dict)

    # -- outputs -------------------------------------------------------------------------
    def quarantine(self, source: str | None = None) -> DataFrame:
        """Invalid lines (of ``source``, or all), one row per (file, line text) with its count."""
        bad = self.parsed.where(F.col("_reason").isNotNull())
        if source is not None:
            bad = bad.where(F.col("source") == source)
        return bad.groupBy("source", "source_file", F.col("_raw").alias("raw_line")).agg(
            F.first("_reason").alias("reason"), F.count(F.lit(1)).alias("occurrences")
        ).select("source", "source_file", "raw_line", "reason", "occurrences", F.lit(self.job.name).alias("detected_by"))

    def _late_condition(self) -> Column:
        if self.bounded:
            return F.lit(False)
        return F.col(WE) + F.lit(self.job.watermark.allowed_lateness_ms) <= F.lit(self.watermark_in_ms)

    def windowed(self) -> DataFrame:
        """Transformed events with their windows and a ``_late`` flag (one row per event and window)."""
        if self._windowed is None:
            job = self.job
            measured = job.transform(self.events())
            needed = (*job.keys, job.source.event_time, job.source.dedup_key)
            missing = [c for c in needed if c not in measured.columns]
            if missing:
                raise DeclarationError(
                    f"job {job.name}: transform output lacks column(s) {missing}; it must keep the keys, the "
                    "event-time column and the dedup key"
                )
            windowed = assign_windows(measured, job, F.unix_millis(F.col(job.source.event_time)))
            self._windowed = windowed.withColumn("_late", self._late_condition())
        return self._windowed

    def late(self) -> DataFrame:
        """Late side output: the event, the window it missed, the watermark and by how much."""
        if self._late is None:
            job, key = self.job, self.job.source.dedup_key
            fields = [f for f in dict.fromkeys(n for s in job.sources for n in s.field_names)]
            originals = self.events().select(
                F.col(key).alias("_id"), F.col("source").alias("_src"), F.col("source_file").alias("_file"),
                F.to_json(F.struct(*[F.col(f) for f in fields])).alias("_event"),
            )
            missed = self.windowed().where(F.col("_late")).select(
                *job.keys, key, job.source.event_time, WS, WE,
            )
            joined = F.broadcast(missed).join(originals, missed[key] == originals["_id"], "left")
            t_ms = F.unix_millis(F.col(job.source.event_time))
            late = joined.select(
                *job.keys,
                F.col(key),
                F.col(job.source.event_time),
                F.timestamp_millis(F.col(WS)).alias("window_start"),
                F.timestamp_millis(F.col(WE)).alias("window_end"),
                F.lit(self.watermark_in_ms).cast("long").alias("watermark_ms"),
                (F.lit(self.watermark_in_ms) - t_ms).cast("long").alias("late_by_ms"),
                F.col("_src").alias("source"), F.col("_file").alias("source_file"), F.col("_event").alias("event"),
            )
            self._late = late if self.bounded else self._cache(late)
        return self._late

    def _measures(self) -> tuple[DataFrame, dict[str, T.DataType]]:
        """One row per on-time (event, window): keys, window and each aggregate's input value (typed)."""
        job = self.job
        windowed = self.windowed().where(~F.col("_late"))
        types = {a.name: aggregate_type(a, windowed.schema) for a in job.aggregates}
        values = [
            (F.lit(1) if a.kind == "count" and a.column == "*" else F.col(a.column)).cast(types[a.name]).alias(a.name)
            for a in job.aggregates
        ]
        return windowed.select(*job.keys, WS, WE, *values), types

    # -- statistics ----------------------------------------------------------------------
    def events(self) -> DataFrame:
        if self._events is None:
            self.stats()
        return self._events  # type: ignore[return-value]

    def stats(self) -> BatchStats:
        """Run the batch's statistics actions (they also fill the cache used by the writes)."""
        if self._stats is None:
            job = self.job
            self._cache(self.parsed)
            valid = F.col("_reason").isNull()
            t_ms = F.unix_millis(job.source.event_time)
            if self.event_range_ms is not None:
                valid = valid & (t_ms >= self.event_range_ms[0]) & (t_ms < self.event_range_ms[1])
            bad_by_source = [F.count(F.when(F.col("_reason").isNotNull() & (F.col("source") == s.name), 1)).alias(s.name)
                             for s in job.sources]
            row = self.parsed.agg(
                F.count(F.lit(1)).alias("_lines"),
                F.count(F.when(valid, 1)).alias("_valid"),
                F.max(F.when(valid, t_ms)).alias("_max_t"),
                F.min(F.when(valid, t_ms)).alias("_min_t"),
                *bad_by_source,
            ).first()
            self.quarantined_by_source = {s.name: row[s.name] for s in job.sources}
            events = self.parsed.where(valid).drop("_raw", "_reason")
            self._events = self._deduplicate(events.withColumn("event_time_ms", t_ms))
            n_events = self._events.count()
            self._stats = BatchStats(
                lines=row["_lines"],
                quarantined=sum(self.quarantined_by_source.values()),
                events=n_events,
                duplicates=row["_valid"] - n_events,
                late=self.late().count() if self._may_be_late(row["_min_t"]) else 0,
                max_event_time_ms=row["_max_t"],
                watermark_in_ms=self.watermark_in_ms,
            )
        return self._stats

    def _may_be_late(self, min_t: int | None) -> bool:
        """Whether any event of the batch can be late (its earliest window already closed)."""
        if self.bounded or min_t is None:
            return False
        reach = self.job.watermark.allowed_lateness_ms
        if isinstance(self.job.window, Session):
            reach += self.job.window.gap_ms  # an event's own session window ends a gap after it
        return min_t + reach < self.watermark_in_ms

    def _deduplicate(self, valid: DataFrame) -> DataFrame:
        """Drop repeated deliveries: within the batch, and of keys remembered from earlier batches.

        ``dropDuplicates`` over the whole batch would shuffle every row. Duplicates are rare, so
        only 64-bit hashes of the key are counted (hash aggregation, combined map-side); rows whose
        hash occurs once pass untouched, and only the few rows with a repeated hash (true
        duplicates, or a hash collision) are deduplicated exactly.
        """
        key = self.job.source.dedup_key
        hashed = valid.withColumn("_h", F.xxhash64(F.col(key)))
        repeated = self._cache(
            hashed.groupBy("_h").agg(F.count(F.lit(1)).alias("_n")).where(F.col("_n") > 1).select("_h")
        )
        n_repeated = repeated.count()
        if n_repeated:
            small = F.broadcast(repeated) if n_repeated <= 2_000_000 else repeated
            once = hashed.join(small, "_h", "left_anti")
            again = hashed.join(small, "_h", "left_semi").dropDuplicates([key])
            hashed = once.unionByName(again)
        events = hashed.drop("_h")
        if self.seen_keys is not None:
            events = events.join(self.seen_keys.select(F.col("key").alias(key)), on=key, how="left_anti")
        return self._cache(events)

    def next_watermark(self) -> int:
        if self.bounded:
            return POS_INF_MS
        max_t = self.stats().max_event_time_ms
        if max_t is None:
            return self.watermark_in_ms
        return max(self.watermark_in_ms, max_t - self.job.watermark.out_of_orderness_ms)

    # -- windows -------------------------------------------------------------------------
    def _merge(self, rows: DataFrame, types: dict[str, T.DataType]) -> DataFrame:
        """Combine partial aggregates per window (sessions: per merged session) in one aggregation."""
        job = self.job
        combine = [
            _agg_expr("sum" if a.kind == "count" else a.kind, a.name).cast(types[a.name]).alias(a.name)
            for a in job.aggregates
        ]
        flags = [
            F.max("_fired").alias("_fired"),
            F.max("_changed").alias("_changed"),
            F.array_distinct(F.flatten(F.collect_list("_in_sink"))).alias("_in_sink"),
        ]
        if not isinstance(job.window, Session):
            return rows.groupBy(*job.keys, WS, WE).agg(*combine, *flags)
        # Gaps and islands: a row starts a new session when it starts after every earlier end of its key.
        order = Window.partitionBy(*job.keys).orderBy(WS, WE)
        before = F.max(WE).over(order.rowsBetween(Window.unboundedPreceding, -1))
        rows = rows.withColumn("_new", F.when(before.isNull() | (F.col(WS) > before), 1).otherwise(0))
        rows = rows.withColumn("_sid", F.sum("_new").over(order.rowsBetween(Window.unboundedPreceding, 0)))
        return rows.groupBy(*job.keys, "_sid").agg(
            F.min(WS).alias(WS), F.max(WE).alias(WE), *combine, *flags
        ).drop("_sid")

    def finish(self, watermark_out_ms: int) -> "BatchOutputs":
        """Merge into the open windows and split what is written from what stays in state."""
        job = self.job
        rows, types = self._measures()
        no_starts = F.array().cast("array<bigint>")
        rows = rows.select("*", F.lit(False).alias("_fired"), F.lit(True).alias("_changed"), no_starts.alias("_in_sink"))
        if self.open_windows is not None:
            rows = self.open_windows.withColumn("_changed", F.lit(False)).unionByName(rows)
        merged = self._cache(self._merge(rows, types))
        fires = F.col(WE) <= F.lit(watermark_out_ms)
        due = fires & (F.col("_changed") | ~F.col("_fired"))
        passing = F.coalesce(F.expr(job.having), F.lit(False)) if job.having else F.lit(True)
        aggs = [a.name for a in job.aggregates]
        written = merged.where(due & passing).select(
            *job.keys,
            F.timestamp_millis(F.col(WS)).alias("window_start"),
            F.timestamp_millis(F.col(WE)).alias("window_end"),
            *aggs,
        )
        if job.upserts and not self.bounded:
            stale = merged.where(due).select(
                *job.keys, F.explode(F.filter("_in_sink", lambda s: (s != F.col(WS)) | ~passing)).alias("_start"),
            ).select(
                *job.keys,
                F.timestamp_millis(F.col("_start")).alias("window_start"),
                F.lit(None).cast("timestamp").alias("window_end"),
                *[F.lit(None).cast(types[a]).alias(a) for a in aggs],
                F.lit("delete").alias(OP),
            )
            written = written.withColumn(OP, F.lit("upsert")).unionByName(stale)
        in_sink = F.when(due, F.when(passing, F.array(F.col(WS))).otherwise(no_starts)).otherwise(F.col("_in_sink"))
        keep = merged.where(F.col(WE) + F.lit(job.watermark.allowed_lateness_ms) > F.lit(watermark_out_ms)).select(
            *job.keys, WS, WE, *aggs, (F.col("_fired") | fires).alias("_fired"), in_sink.alias("_in_sink"),
        )
        seen = None
        if not self.bounded:
            key = job.source.dedup_key
            expires = F.greatest(F.col("event_time_ms"), F.lit(self.watermark_in_ms)) + F.lit(
                int(job.dedup_ttl.total_seconds() * 1000)
            )
            seen = self.events().select(F.col(key).cast("string").alias("key"), expires.alias("expires_ms"))
            if self.seen_keys is not None:
                seen = self.seen_keys.unionByName(seen)
            seen = seen.where(F.col("expires_ms") > F.lit(watermark_out_ms))
        return BatchOutputs(written=written, open_windows=keep, seen_keys=seen)

    def release(self) -> None:
        for frame in self._cached:
            frame.unpersist()
        self._cached.clear()

    def _cache(self, frame: DataFrame) -> DataFrame:
        if frame not in self._cached:
            frame.persist(StorageLevel.MEMORY_AND_DISK)
            self._cached.append(frame)
        return frame


@dataclass(frozen=True)
class BatchOutputs:
    written: DataFrame  # rows for the sink (with an ``_op`` column when the job upserts)
    open_windows: DataFrame
    seen_keys: DataFrame | None


def parse_sources(job, raw: DataFrame) -> DataFrame:
    """Every line of every source of ``job``: typed fields (unioned by name), ``source``, reasons."""
    frames = []
    for source in job.sources:
        lines = raw.where(F.col(SOURCE) == source.name) if len(job.sources) > 1 else raw
        frames.append(parse(lines, source).withColumn("source", F.lit(source.name)))
    parsed = frames[0]
    for frame in frames[1:]:
        parsed = parsed.unionByName(frame, allowMissingColumns=True)
    return parsed


def plan_batch(
    job: WindowedJob,
    raw: DataFrame,
    *,
    watermark_in_ms: int = NEG_INF_MS,
    open_windows: DataFrame | None = None,
    seen_keys: DataFrame | None = None,
    bounded: bool = False,
    event_range_ms: tuple[int, int] | None = None,
) -> BatchPlan:
    """Build the batch's frames from raw lines (``value``, ``source_file`` and, multi-source, ``_source``)."""
    parsed = parse_sources(job, raw)
    # Only quarantined and late rows report their file. Dropping it elsewhere keeps the batch's
    # cache small: an uncompressed path string per event costs more than all its fields together.
    # (An event is late only for a window that ended before W_in, so its event time is before W_in.)
    needs_file = F.col("_reason").isNotNull()
    if not bounded:
        needs_file = needs_file | (F.unix_millis(F.col(job.source.event_time)) < F.lit(watermark_in_ms))
    parsed = parsed.withColumn("source_file", F.when(needs_file, F.col("source_file")))
    return BatchPlan(
        job=job,
        watermark_in_ms=watermark_in_ms,
        bounded=bounded,
        parsed=parsed,
        open_windows=open_windows,
        seen_keys=seen_keys,
        event_range_ms=event_range_ms,
    )
