"""The event-time engine: one micro-batch (or one bounded run) of a windowed job.

The same code serves the stream (inside ``foreachBatch``, with state carried between batches)
and the bounded twin (one call, empty state, perfect watermark). It only builds DataFrames and
runs the small actions of the batch statistics (and of duplicate detection); the runners do the I/O.

Per batch, with ``W_in`` the watermark at the start of the batch (see ``declaration``):

1. parse lines; invalid ones become quarantine rows (grouped per file and line text);
2. drop duplicate deliveries (``dedup_key``) within the batch and against the keys seen in
   earlier batches (kept until ``max(event_time, W_in) + dedup_ttl <= W``);
3. assign windows; an event whose window satisfies ``end + allowed_lateness <= W_in`` is late and
   goes to the late side output; the rest are transformed;
4. aggregate them per key and window together with the open windows kept from earlier batches
   (one aggregation, partial aggregates combined map-side);
5. ``W_out = max(W_in, max event time of the batch - out_of_orderness)`` (bounded: +infinity);
   windows with ``end <= W_out`` fire; a window is kept in state until ``end + allowed_lateness > W_out``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from .declaration import Agg, WindowedJob
from .parse import parse

NEG_INF_MS = -(2**62)
POS_INF_MS = 2**62

WS, WE = "window_start_ms", "window_end_ms"


@dataclass(frozen=True)
class BatchStats:
    """What one micro-batch (or bounded run) did; all counts are exact."""

    lines: int = 0
    quarantined: int = 0
    events: int = 0  # valid, deduplicated events (on time + late)
    duplicates: int = 0
    late: int = 0
    windows_written: int = 0
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
            windows_written=self.windows_written + other.windows_written,
            max_event_time_ms=mx(self.max_event_time_ms, other.max_event_time_ms),
            watermark_in_ms=min(self.watermark_in_ms, other.watermark_in_ms),
            watermark_out_ms=max(self.watermark_out_ms, other.watermark_out_ms),
        )


def _agg_expr(agg: Agg, source: str) -> Column:
    if agg.kind == "count":
        return F.count(F.lit(1)) if source == "*" else F.sum(source)
    fn = {"sum": F.sum, "min": F.min, "max": F.max}[agg.kind]
    return fn(source)


def _agg_type(agg: Agg, schema: T.StructType) -> T.DataType:
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


def assign_windows(frame: DataFrame, job: WindowedJob, time_col: str) -> DataFrame:
    """Add ``window_start_ms``/``window_end_ms``: the half-open window ``[start, end)`` of each row."""
    size = job.window.size_ms
    ms = F.unix_millis(F.col(time_col))
    start = ms - F.pmod(ms, F.lit(size))
    return frame.withColumn(WS, start).withColumn(WE, start + F.lit(size))


@dataclass
class BatchPlan:
    """The lazily built frames of one batch. Call :meth:`stats` once, then :meth:`finish`."""

    job: WindowedJob
    watermark_in_ms: int
    bounded: bool
    parsed: DataFrame
    events: DataFrame  # valid, with event_time_ms and window columns; deduplicated by stats()
    open_windows: DataFrame | None
    seen_keys: DataFrame | None
    event_range_ms: tuple[int, int] | None = None
    _cached: list[DataFrame] = field(default_factory=list)
    _stats: BatchStats | None = None

    # -- outputs -------------------------------------------------------------------------
    def quarantine(self) -> DataFrame:
        """Invalid lines, one row per (file, line text) with its number of occurrences."""
        bad = self.parsed.where(F.col("_reason").isNotNull())
        return bad.groupBy("source_file", F.col("_raw").alias("raw_line")).agg(
            F.first("_reason").alias("reason"), F.count(F.lit(1)).alias("occurrences")
        ).select(
            F.lit(self.job.source.name).alias("source"),
            "source_file",
            "raw_line",
            "reason",
            "occurrences",
            F.lit(self.job.name).alias("detected_by"),
        )

    def _late_condition(self) -> Column:
        if self.bounded:
            return F.lit(False)
        horizon = F.col(WE) + F.lit(self.job.watermark.allowed_lateness_ms)
        return horizon <= F.lit(self.watermark_in_ms)

    def late(self) -> DataFrame:
        """Late side output: the original event, the window it missed, the watermark and by how much."""
        self.stats()
        fields = list(self.job.source.field_names)
        return self.events.where(self._late_condition()).select(
            *fields,
            "source_file",
            F.timestamp_millis(F.col(WS)).alias("window_start"),
            F.timestamp_millis(F.col(WE)).alias("window_end"),
            F.lit(self.watermark_in_ms).cast("long").alias("watermark_ms"),
            (F.lit(self.watermark_in_ms) - F.col("event_time_ms")).cast("long").alias("late_by_ms"),
        )

    def _measures(self) -> tuple[DataFrame, dict[str, T.DataType]]:
        """One row per on-time event: keys, window and each aggregate's input value (already typed)."""
        job = self.job
        self.stats()
        measured = job.transform(self.events.where(~self._late_condition()))
        missing = [c for c in (*job.keys, job.source.event_time) if c not in measured.columns]
        if missing:
            from .errors import DeclarationError

            raise DeclarationError(
                f"job {job.name}: transform output lacks column(s) {missing}; it must keep the keys and the event-time column"
            )
        windowed = assign_windows(measured, job, job.source.event_time)
        types = {a.name: _agg_type(a, measured.schema) for a in job.aggregates}
        values = [
            (F.lit(1) if a.kind == "count" and a.column == "*" else F.col(a.column)).cast(types[a.name]).alias(a.name)
            for a in job.aggregates
        ]
        return windowed.select(*job.keys, WS, WE, *values), types

    def stats(self) -> BatchStats:
        """Run the batch's statistics actions (they also fill the cache used by the writes)."""
        if self._stats is None:
            self._cache(self.parsed)
            valid = F.col("_reason").isNull()
            t_ms = F.unix_millis(self.job.source.event_time)
            if self.event_range_ms is not None:
                valid = valid & (t_ms >= self.event_range_ms[0]) & (t_ms < self.event_range_ms[1])
            row = self.parsed.agg(
                F.count(F.lit(1)).alias("lines"),
                F.count("_reason").alias("bad"),
                F.count(F.when(valid, 1)).alias("valid"),
                F.max(F.when(valid, t_ms)).alias("max_t"),
            ).first()
            self.events = self._deduplicate(self.events)
            ev = self.events.agg(
                F.count(F.lit(1)).alias("events"), F.count(F.when(self._late_condition(), 1)).alias("late")
            ).first()
            valid = row["valid"]
            self._stats = BatchStats(
                lines=row["lines"],
                quarantined=row["bad"],
                events=ev["events"],
                duplicates=valid - ev["events"],
                late=ev["late"],
                max_event_time_ms=row["max_t"],
                watermark_in_ms=self.watermark_in_ms,
            )
        return self._stats

    def _deduplicate(self, valid: DataFrame) -> DataFrame:
        """Drop repeated deliveries: within the batch, and of keys remembered from earlier batches.

        ``dropDuplicates`` over the whole batch would shuffle every row (and aggregate strings by
        sorting). Duplicates are rare, so only 64-bit hashes of the key are counted (hash
        aggregation, combined map-side); rows whose hash occurs once pass untouched, and only the
        few rows with a repeated hash (true duplicates, or a hash collision) are deduplicated exactly.
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
            events = events.join(self.seen_keys.select(key), on=key, how="left_anti")
        return events

    def next_watermark(self) -> int:
        if self.bounded:
            return POS_INF_MS
        max_t = self.stats().max_event_time_ms
        if max_t is None:
            return self.watermark_in_ms
        return max(self.watermark_in_ms, max_t - self.job.watermark.out_of_orderness_ms)

    def finish(self, watermark_out_ms: int) -> "BatchOutputs":
        """Merge into the open windows and split what fires from what stays in state."""
        job = self.job
        rows, types = self._measures()
        rows = rows.withColumn("_emitted", F.lit(False)).withColumn("_changed", F.lit(True))
        if self.open_windows is not None:
            previous = self.open_windows.withColumn("_changed", F.lit(False))
            rows = previous.unionByName(rows)
        # One aggregation merges this batch's events into the open windows (partial sums map-side).
        merge_kind = {"count": "sum"}
        merged = rows.groupBy(*job.keys, WS, WE).agg(
            *[
                _agg_expr(Agg(merge_kind.get(a.kind, a.kind), a.name), a.name).cast(types[a.name]).alias(a.name)
                for a in job.aggregates
            ],
            F.max("_emitted").alias("_emitted"),
            F.max("_changed").alias("_changed"),
        )
        merged = self._cache(merged)
        fires = F.col(WE) <= F.lit(watermark_out_ms)
        emitted = merged.where(fires & (~F.col("_emitted") | F.col("_changed"))).select(
            *job.keys,
            F.timestamp_millis(F.col(WS)).alias("window_start"),
            F.timestamp_millis(F.col(WE)).alias("window_end"),
            *[a.name for a in job.aggregates],
        )
        keep = merged.where(F.col(WE) + F.lit(job.watermark.allowed_lateness_ms) > F.lit(watermark_out_ms)).select(
            *job.keys, WS, WE, *[a.name for a in job.aggregates], (F.col("_emitted") | fires).alias("_emitted")
        )
        seen = None
        if not self.bounded:
            key = job.source.dedup_key
            expires = F.greatest(F.col("event_time_ms"), F.lit(self.watermark_in_ms)) + F.lit(
                int(job.dedup_ttl.total_seconds() * 1000)
            )
            seen = self.events.select(key, expires.alias("expires_ms"))
            if self.seen_keys is not None:
                seen = self.seen_keys.unionByName(seen)
            seen = seen.where(F.col("expires_ms") > F.lit(watermark_out_ms))
        return BatchOutputs(emitted=emitted, open_windows=keep, seen_keys=seen)

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
    emitted: DataFrame
    open_windows: DataFrame
    seen_keys: DataFrame | None


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
    """Build the batch's frames from raw lines (``value``, ``source_file``)."""
    parsed = parse(raw, job.source)
    # Only quarantined and late rows report their file. Dropping it elsewhere keeps the batch's
    # cache small: an uncompressed path string per event costs more than all its fields together.
    # (An event is late only if its window ended before W_in, so its event time is before W_in.)
    needs_file = F.col("_reason").isNotNull()
    if not bounded:
        needs_file = needs_file | (F.unix_millis(F.col(job.source.event_time)) < F.lit(watermark_in_ms))
    parsed = parsed.withColumn("source_file", F.when(needs_file, F.col("source_file")))
    events = parsed.where(F.col("_reason").isNull()).drop("_raw", "_reason")
    events = events.withColumn("event_time_ms", F.unix_millis(F.col(job.source.event_time)))
    if event_range_ms is not None:
        lo, hi = event_range_ms
        events = events.where((F.col("event_time_ms") >= lo) & (F.col("event_time_ms") < hi))
    events = assign_windows(events, job, job.source.event_time)
    return BatchPlan(
        job=job,
        watermark_in_ms=watermark_in_ms,
        bounded=bounded,
        parsed=parsed,
        events=events,
        open_windows=open_windows,
        seen_keys=seen_keys,
        event_range_ms=event_range_ms,
    )
