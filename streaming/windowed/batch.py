"""The event-time engine of windowed jobs: one micro-batch of a stream, or one bounded run.

The same code serves the stream (inside ``foreachBatch``: earlier batches reach it through the
incremental ``store``) and the bounded twin (one call, nothing before it, a perfect watermark). It
builds DataFrames; the handlers and runners do the I/O.

Per batch, with ``W_in`` the watermark at its start, ``d`` the out-of-orderness and ``L`` the allowed
lateness (see ``declaration`` for the rules):

1. parse the lines of every source; invalid ones become quarantine rows (per file and line text);
2. drop repeated deliveries: within the batch, and of ids remembered from earlier batches
   (an id is remembered until ``max(event time, W_in) + dedup_ttl <= W``);
3. transform the events and assign windows (a sliding-window event yields one row per window; a
   session event opens ``[t, t + gap)``); a (row, window) with ``end + L <= W_in`` is late and goes to
   the late side output with the original event; the rest become this batch's *pieces*: partial
   aggregates per window (sessions: per merged interval);
4. ``W_out = max(W_in, max event time of the batch - d)`` (bounded: +infinity). A window *fires* when
   ``end <= W_out``: the first time it gets there, and again each time on-time events change it while
   ``end + L > W``; its value is the combination of all its pieces. Without lateness each window is
   written once (append); with lateness a changed window is written again (upsert on keys +
   ``window_start``), and rows of sessions it absorbed, or of windows that no longer satisfy
   ``having``, are deleted.

Only the pieces of windows that fire are read back, so a batch costs what it brings, not what the
stream remembers.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, Observation, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from ..spark.columns import as_param, group, in_set, once, param, select
from ..spark.jvm import cached_leaf
from ..declaration import Agg, WindowedJob
from ..errors import DeclarationError
from ..io.landing import SOURCE
from ..io.parse import parse
from ..io.sinks.base import OP
from ..checkpoint.store import (BUCKET_MS, COMPACT_EVERY, MAX_BUCKETS, Manifest, Store, StoreFile, bucket_of, id_hashes, observe,
                    observed, packed)
from ..windows import Session, Sliding

NEG_INF_MS = -(2**62)
POS_INF_MS = 2**62
WS, WE = "ws", "we"


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
    """The fixed type of an aggregate, so pieces and sink keep one schema across batches."""
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
    """Add ``ws``/``we``: the half-open windows ``[start, end)`` of each row, in ms."""
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


# A stream's batch (of more than ``INTERPRETED_BATCH_LINES``) with at most this many ids delivered more
# than once drops the repeats by a filter (see ``WindowedBatch.repeats``); their hashes reach the driver
# (24 bytes each).
MAX_REPEATS = 10_000
TAG = "_line"  # a valid line's number within its batch (see ``WindowedBatch._tagged``)


def _one_window(job: WindowedJob) -> tuple[Column, Column, Column]:
    """``*``, start and end of the one tumbling (or non-overlapping sliding) window of each row, in ms."""
    time_ms = F.unix_millis(F.col(job.source.event_time))
    start = time_ms - F.pmod(time_ms, F.lit(job.window.every_ms))
    return F.col("*"), start, start + F.lit(job.window.size_ms)


def _check_transform_output(job: WindowedJob, columns: list[str]) -> bool:
    needed = (*job.keys, job.source.event_time, job.source.dedup_key)
    missing = [c for c in needed if c not in columns]
    if missing:
        raise DeclarationError(
            f"job {job.name}: transform output lacks column(s) {missing}; it must keep the keys, the "
            "event-time column and the dedup key"
        )
    return True


def parse_sources(job, raw: DataFrame, *, barrier: bool = True) -> DataFrame:
    """Every line of every source of ``job``: typed fields (unioned by name), ``source``, reasons
    (``barrier``: see :func:`parse`)."""
    frames = []
    for source in job.sources:
        lines = raw.where(F.col(SOURCE) == source.name) if len(job.sources) > 1 else raw
        frames.append(parse(lines, source, barrier=barrier).withColumn("source", F.lit(source.name)))
    parsed = frames[0]
    for frame in frames[1:]:
        parsed = parsed.unionByName(frame, allowMissingColumns=True)
    return parsed


def transform_inputs(job, schema: T.StructType) -> set[str]:
    """The columns of ``schema`` that ``job.transform`` reads or passes on: found by optimising the
    transform over an empty frame Spark cannot see is empty (column pruning leaves what it needs)."""
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    out = job.transform(spark.createDataFrame(spark.sparkContext.emptyRDD(), schema))
    names = set(out.columns)
    nodes = [out._jdf.queryExecution().optimizedPlan()]  # noqa: SLF001
    while nodes:
        node = nodes.pop()
        names.update(a.name() for a in _iterate(node.references().toSeq()))
        nodes.extend(_iterate(node.children()))
    return names & set(schema.names)


def _iterate(seq):
    it = seq.iterator()
    while it.hasNext():
        yield it.next()


def _bounded_columns(job: WindowedJob, parsed: DataFrame) -> list[str]:
    engine = {"source", "source_file", "_raw", "_reason", job.source.event_time, job.source.dedup_key, *job.keys}
    needed = transform_inputs(job, parsed.schema) | engine
    return [c for c in parsed.columns if c in needed]


class Windows:
    """How a job's pieces combine: per window (tumbling, sliding) or per merged session."""

    def __init__(self, job: WindowedJob, types: dict[str, T.DataType]):
        self.job = job
        self.types = types
        self.aggs = [a.name for a in job.aggregates]

    def combine(self) -> list[Column]:
        return once("combine", lambda: [
            _agg_expr("sum" if a.kind == "count" else a.kind, a.name).cast(self.types[a.name]).alias(a.name)
            for a in self.job.aggregates], self.job)

    def merge(self, pieces: DataFrame, extra: list[Column] = ()) -> DataFrame:
        """One row per window (sessions: per set of pieces that overlap or touch) with its value."""
        keys = self.job.keys
        if not isinstance(self.job.window, Session):
            groups = once("window groups", lambda: [F.col(c) for c in (*keys, WS, WE)], self.job)
            if not extra:
                return group(pieces, groups, self.combine())
            return pieces.groupBy(*groups).agg(*self.combine(), *extra)
        # Gaps and islands: a piece starts a new session when it starts after every earlier end of its key.
        order = Window.partitionBy(*keys).orderBy(WS, WE)
        before = F.max(WE).over(order.rowsBetween(Window.unboundedPreceding, -1))
        pieces = pieces.withColumn("_new", F.when(before.isNull() | (F.col(WS) > before), 1).otherwise(0))
        pieces = pieces.withColumn("_sid", F.sum("_new").over(order.rowsBetween(Window.unboundedPreceding, 0)))
        return pieces.groupBy(*keys, "_sid").agg(F.min(WS).alias(WS), F.max(WE).alias(WE), *self.combine(),
                                                 *extra).drop("_sid")

    def passing(self) -> Column:
        return F.coalesce(F.expr(self.job.having), F.lit(False)) if self.job.having else F.lit(True)

    def sink_rows(self, windows: DataFrame) -> DataFrame:
        """The main table's columns of merged windows."""
        return select(windows, once("sink columns", lambda: [
            *[F.col(c) for c in self.job.keys], F.timestamp_millis(F.col(WS)).alias("window_start"),
            F.timestamp_millis(F.col(WE)).alias("window_end"), *[F.col(a) for a in self.aggs]], self.job))

    def deletes(self, keys_and_starts: DataFrame) -> DataFrame:
        """Delete rows (``_op = delete``) for (keys, ``ws``) of sink rows to retract."""
        return keys_and_starts.select(
            *self.job.keys, F.timestamp_millis(F.col(WS)).alias("window_start"),
            F.lit(None).cast("timestamp").alias("window_end"),
            *[F.lit(None).cast(self.types[a]).alias(a) for a in self.aggs], F.lit("delete").alias(OP),
        )


@dataclass
class Fired:
    """What a batch writes to the main table (with ``_op`` when the job upserts), and to the store."""

    rows: DataFrame | None = None
    store: dict[str, DataFrame] = field(default_factory=dict)


# Below this many lines a batch is "small": fewer, simpler Spark plans (see ``WindowedBatch.events``
# and the handler), since per-plan overhead, not data, decides its time.
SMALL_BATCH_LINES = 100_000
# Below this many lines a batch's plans after the statistics run interpreted, without generated code:
# measured when their literals (the watermark, the batch's buckets) were still written into the code,
# so each batch compiled ~10 new classes (10-35 ms each, on the batch's own thread) that the JIT then
# compiled again. Those values are parameters now (``columns.param``); not re-measured since.
INTERPRETED_BATCH_LINES = 20_000
_TYPES: dict[tuple, dict[str, T.DataType]] = {}
_UNKNOWN = object()  # (not found yet)
_OBSERVATIONS = itertools.count()


@dataclass
class WindowedBatch:
    """The lazily built frames of one batch. A stream's batch: call :meth:`stats` first (it caches the
    parsed lines). Bounded: the firing's pass counts the statistics; call :meth:`stats` after it."""

    job: WindowedJob
    watermark_in_ms: int
    bounded: bool
    parsed: DataFrame  # every line of every source: fields, source, source_file, _raw, _reason
    store: Store | None = None  # the stream's earlier batches (None: bounded, or the first batch)
    event_range_ms: tuple[int, int] | None = None
    batch_id: int = 0
    # A stream's batch expected to be large (the one before it was): its statistics job also finds the ids
    # delivered more than once (see :meth:`repeats`), one job and one pass over the cached lines less.
    expect_large: bool = False
    _stats: BatchStats | None = None
    _min_t: int | None = None
    _buckets: set[int] | None = field(default_factory=set)  # event-time buckets of the valid events (None: too many)
    _events: DataFrame | None = None
    _repeats: tuple[list[int], list[int], list[int]] | None | object = _UNKNOWN
    _observation: Observation | None = None
    _lines_seen: Observation | None = None
    _observed_lines: DataFrame | None = None
    _leaf: DataFrame | None = None  # a stream's cached lines, as a plan of one node (see ``spark.jvm.cached_leaf``)
    _windowed: DataFrame | None = None
    _cached: list[DataFrame] = field(default_factory=list)
    quarantined_by_source: dict[str, int] = field(default_factory=dict)

    @property
    def ttl_ms(self) -> int:
        return int(self.job.dedup_ttl.total_seconds() * 1000)

    # -- statistics (stream: one Spark job, which also caches the batch's lines; bounded: counted by
    #    the firing's pass, with no job of their own) ----------------------------------------
    def _valid(self) -> Column:
        if self.event_range_ms is None:
            return once("valid", lambda: F.col("_reason").isNull())
        valid = F.col("_reason").isNull()
        if self.event_range_ms is not None:
            t_ms = F.unix_millis(self.job.source.event_time)
            valid = valid & (t_ms >= self.event_range_ms[0]) & (t_ms < self.event_range_ms[1])
        return valid

    def _stat_columns(self) -> list[Column]:
        if self.event_range_ms is None:
            return once("stat columns", self._build_stat_columns, self.job)
        return self._build_stat_columns()

    def _build_stat_columns(self) -> list[Column]:
        job, valid = self.job, self._valid()
        t_ms = F.unix_millis(job.source.event_time)
        bad = [F.count(F.when(F.col("_reason").isNotNull() & (F.col("source") == s.name), 1)).alias(s.name)
               for s in job.sources]
        buckets = F.collect_set(F.when(valid, bucket_of(t_ms)))  # (NULL when too many to list: all)
        extra = [] if self.bounded else [F.when(F.size(buckets) <= MAX_BUCKETS, buckets).alias("_buckets")]
        return [F.count(F.lit(1)).alias("_lines"), F.count(F.when(valid, 1)).alias("_valid"),
                F.max(F.when(valid, t_ms)).alias("_max_t"), F.min(F.when(valid, t_ms)).alias("_min_t"), *bad, *extra]

    def _cached_lines(self) -> DataFrame:
        """Every parsed line, cached (a stream's: as the cache alone, see ``spark.jvm.cached_leaf``)."""
        self._cache(self.parsed)
        if self.bounded:
            return self.parsed
        if self._leaf is None:
            self._leaf = cached_leaf(self.parsed)
        return self._leaf

    def _lines(self) -> DataFrame:
        """Every parsed line, cached. Bounded: also counted on the way (the firing's pass reads them all)."""
        lines = self._cached_lines()
        if not self.bounded:
            return lines
        if self._lines_seen is None:
            self._lines_seen = Observation(f"lines-{self.job.name}-{next(_OBSERVATIONS)}")
            self._observed_lines = observe(self.parsed, self._lines_seen, self._stat_columns())
        return self._observed_lines

    def stats(self) -> BatchStats:
        """The batch's statistics. Bounded: call it after an action over :meth:`fire`'s rows has run."""
        if self._stats is None:
            job = self.job
            if self.bounded:
                row = observed(self._lines_seen)
            elif self.expect_large:
                seen = Observation(f"stats-{job.name}-{next(_OBSERVATIONS)}")
                self._repeats = self._find_repeats(observe(self._lines(), seen, once("packed stats", lambda: packed(
                    self._stat_columns()), job)))
                row = observed(seen)
            else:
                row = self._lines().agg(*self._stat_columns()).first()
            self.quarantined_by_source = {s.name: row[s.name] for s in job.sources}
            self._buckets = set() if self.bounded else None if row["_buckets"] is None else set(row["_buckets"])
            self._stats = BatchStats(lines=row["_lines"], quarantined=sum(self.quarantined_by_source.values()),
                                     events=row["_valid"], max_event_time_ms=row["_max_t"],
                                     watermark_in_ms=self.watermark_in_ms)
            self._min_t = row["_min_t"]
        return self._stats

    def next_watermark(self) -> int:
        if self.bounded:
            return POS_INF_MS
        max_t = self.stats().max_event_time_ms
        if max_t is None:
            return self.watermark_in_ms
        return max(self.watermark_in_ms, max_t - self.job.watermark.out_of_orderness_ms)

    # -- outputs ---------------------------------------------------------------------------
    def quarantine(self, source: str | None = None) -> DataFrame:
        """Invalid lines (of ``source``, or all), one row per (file, line text) with its count."""
        lines = self._cached_lines()
        where, keys, values, columns = once(("quarantine", source), lambda: (
            F.col("_reason").isNotNull() & (F.lit(True) if source is None else F.col("source") == source),
            [F.col("source"), F.col("source_file"), F.col("_raw").alias("raw_line")],
            [F.first("_reason").alias("reason"), F.count(F.lit(1)).alias("occurrences")],
            [F.col(c) for c in ("source", "source_file", "raw_line", "reason", "occurrences")]
            + [F.lit(self.job.name).alias("detected_by")],
        ), self.job)
        return select(group(lines.where(where), keys, values), columns)

    def events(self) -> DataFrame:
        """Valid events, each delivery once: repeated ids within the batch and ids the stream
        remembers are dropped. See :meth:`repeats` for how repeats within a stream's batch go."""
        if self._events is None:
            if not self.bounded:
                self.stats()  # the batch's id buckets, for the remembered ids
            job = self.job
            key = job.source.dedup_key
            known = self._repeats is not _UNKNOWN
            repeats = self.repeats() if not self.bounded and (known or self.stats().events > INTERPRETED_BATCH_LINES) else None
            valid = (self._lines().where(self._valid()) if repeats is None else self._tagged()).drop("_raw", "_reason")
            added = once("event columns", lambda: [
                F.col("*"), F.unix_millis(job.source.event_time).alias("event_time_ms"), *id_hashes(F.col(key))], job)
            events = select(valid, added)
            if repeats is None:
                events = events.dropDuplicates([key])
            else:
                if repeats[0]:
                    h1, h2, kept = (in_set(c, v) for c, v in zip(("_h1", "_h2", TAG), repeats))
                    events = events.where(~(h1 & h2) | kept)
                events = events.drop(TAG)
            remembered = self.store.ids(self._buckets) if self.store is not None and self._buckets != set() else None
            if remembered is not None:
                live = remembered.where(as_param(F.col("_expires_ms")) > param(self.watermark_in_ms)).select("_h1", "_h2")
                events = events.join(live, ["_h1", "_h2"], "left_anti")
            if self.bounded:
                # Read once, by the firing: counted on the way instead of cached (a million events cost
                # seconds to cache, and the bounded run reads them only once more, if ever).
                self._observation = Observation(f"events-{self.job.name}-{next(_OBSERVATIONS)}")
                self._events = observe(events, self._observation, once("events metric", lambda: packed([F.count(F.lit(1)).alias("n")])))
            elif repeats is not None and remembered is None:
                # A filter over the cached lines: read again by each of its readers (the store's ids, the
                # windows, the late rows), which measured faster than caching 50k events once more.
                self._events = events
            else:
                self._events = self.cache(events)
        return self._events

    def repeats(self) -> tuple[list[int], list[int], list[int]] | None:
        """A stream's ids delivered more than once in the batch: their hashes ``_h1`` and ``_h2``, and the
        line kept of each (the first); None when there are too many to filter (``dropDuplicates`` instead).

        Repeats are rare: this aggregates 24 bytes per line by hash, without sorting, and the events
        are then filtered where they are, without a shuffle. ``dropDuplicates`` over the events shuffles
        whole rows and sorts them (its aggregate keeps strings, so Spark sorts instead of hashing): in a
        stream of 50k-line batches that cost ~0.35 s per batch. A small batch (up to
        ``INTERPRETED_BATCH_LINES``) uses ``dropDuplicates``: there the sort is small and a job of its own
        is a fixed cost per batch (the one ``make bench`` with it on 500-line batches had ``purchase_metrics``
        at p99 1.62 s against 1.19 s the run before; one run, on a noisy machine). A batch expected to be
        large finds them in its statistics job (see :meth:`stats`)."""
        if self._repeats is _UNKNOWN:
            self._repeats = self._find_repeats(self._lines())
        return self._repeats  # type: ignore[return-value]

    def _find_repeats(self, lines: DataFrame) -> tuple[list[int], list[int], list[int]] | None:
        key = self.job.source.dedup_key
        columns, keys, aggregates, repeated, out = once("repeats", lambda: (
            [F.col(TAG), *id_hashes(F.col(key))], [F.col("_h1"), F.col("_h2")],
            [F.count(F.lit(1)).alias("_n"), F.min(TAG).alias("_kept")], F.col("_n") > 1,
            [F.col("_h1"), F.col("_h2"), F.col("_kept")]), self.job)
        found = select(group(select(self._tagged(lines), columns), keys, aggregates).where(repeated), out)
        rows = found.limit(MAX_REPEATS + 1).collect()
        if len(rows) > MAX_REPEATS:
            return None
        return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]

    def _tagged(self, lines: DataFrame | None = None) -> DataFrame:
        """The valid lines with ``TAG``, each line's number in the batch: the same numbers every time (Spark
        numbers the rows of each partition of the cached lines in order; ``lines``: the cached lines, or a
        frame that passes each of their rows through in order, as the statistics' observation does)."""
        return (self._lines() if lines is None else lines).where(self._valid()).withColumn(TAG, F.monotonically_increasing_id())

    def events_seen(self) -> int:
        """Bounded: the events the firing read (after an action over :meth:`fire`'s rows has run)."""
        return int(observed(self._observation)["n"] or 0)

    def new_ids(self) -> DataFrame:
        """The ids this batch brings, with when they are forgotten: ``max(event time, W_in) + dedup_ttl``."""
        t, bucket, hashes = once("new ids", lambda: (
            F.col("event_time_ms"), bucket_of(F.col("event_time_ms")).alias("_b"), [F.col("_h1"), F.col("_h2")]))
        expires = F.greatest(as_param(t), param(self.watermark_in_ms)).cast("long") + F.lit(self.ttl_ms)
        return self.events().select(bucket, *hashes, expires.alias("_expires_ms"))

    def _late_condition(self, we: Column | None = None) -> Column:
        if self.bounded:
            return F.lit(False)
        we = F.col(WE) if we is None else we
        return as_param(we + F.lit(self.job.watermark.allowed_lateness_ms)) <= param(self.watermark_in_ms)

    def windowed(self) -> DataFrame:
        """Transformed events with their windows and a ``_late`` flag (one row per event and window)."""
        if self._windowed is None:
            job = self.job
            measured = job.transform(self.events())
            once("transform output checked", lambda: _check_transform_output(job, measured.columns), job)
            window = job.window
            if isinstance(window, Session) or (isinstance(window, Sliding) and window.windows_per_event > 1):
                windowed = assign_windows(measured, job, F.unix_millis(F.col(job.source.event_time)))
                self._windowed = windowed.withColumn("_late", self._late_condition())
            else:  # one window per event: one projection, its expressions built once per job
                every_star, ws, we = once("one window", lambda: _one_window(job), job)
                late = self._late_condition(we)
                self._windowed = measured.select(every_star, ws.alias(WS), we.alias(WE), late.alias("_late"))
        return self._windowed

    def late(self) -> DataFrame:
        """Late side output: the event, the window it missed, the watermark and by how much."""
        job, key = self.job, self.job.source.dedup_key
        fields = [f for f in dict.fromkeys(n for s in job.sources for n in s.field_names)]
        originals = self.events().select(
            F.col(key).alias("_id"), F.col("source").alias("_src"), F.col("source_file").alias("_file"),
            F.to_json(F.struct(*[F.col(f) for f in fields])).alias("_event"),
        )
        missed = self.windowed().where(F.col("_late")).select(*job.keys, key, job.source.event_time, WS, WE)
        joined = missed.join(originals, missed[key] == originals["_id"], "left")
        t_ms = F.unix_millis(F.col(job.source.event_time))
        return joined.select(
            *job.keys, F.col(key), F.col(job.source.event_time),
            F.timestamp_millis(F.col(WS)).alias("window_start"), F.timestamp_millis(F.col(WE)).alias("window_end"),
            F.lit(self.watermark_in_ms).cast("long").alias("watermark_ms"),
            (F.lit(self.watermark_in_ms) - t_ms).cast("long").alias("late_by_ms"),
            F.col("_src").alias("source"), F.col("_file").alias("source_file"), F.col("_event").alias("event"),
        )

    def may_be_late(self) -> bool:
        """Whether any event of the batch can be late (its earliest window already closed)."""
        self.stats()
        min_t = self._min_t
        if self.bounded or min_t is None:
            return False
        reach = self.job.watermark.allowed_lateness_ms
        if isinstance(self.job.window, Session):
            reach += self.job.window.gap_ms  # an event's own session window ends a gap after it
        return min_t + reach < self.watermark_in_ms

    def types(self) -> dict[str, T.DataType]:
        """The aggregates' types (fixed by the job's declaration: worked out once per job and process)."""
        key = (self.job.name, self.job.fingerprint(), self.job.transform, tuple(self.job.sources))
        if key not in _TYPES:
            schema = self.windowed().schema
            _TYPES[key] = {a.name: aggregate_type(a, schema) for a in self.job.aggregates}
        return _TYPES[key]

    def pieces(self) -> DataFrame:
        """This batch's partial aggregates of on-time events: per window (sessions: per merged interval)."""
        job = self.job
        types = self.types()
        on_time, columns = once("piece columns", lambda: (~F.col("_late"), [F.col(c) for c in (*job.keys, WS, WE)] + [
            (F.lit(1) if a.kind == "count" and a.column == "*" else F.col(a.column)).cast(types[a.name]).alias(a.name)
            for a in job.aggregates]), job)
        return Windows(job, types).merge(select(self.windowed().where(on_time), columns))

    # -- firing ----------------------------------------------------------------------------
    def fire(self, watermark_out_ms: int) -> Fired:
        """The main-table rows of the windows due at ``W_out``, and what the store must remember."""
        job = self.job
        windows = Windows(job, self.types())
        pieces = self.pieces()
        if self.bounded:
            merged = windows.merge(pieces)
            return Fired(rows=windows.sink_rows(merged.where(windows.passing())))
        store = {"ids": self.new_ids(), "pieces": pieces}
        if isinstance(job.window, Session):
            store["pieces"] = pieces = self.cache(pieces)  # read by the store's write and by the firing
            return self._fire_sessions(watermark_out_ms, windows, pieces, store)
        return self._fire_windows(watermark_out_ms, windows, pieces, store)

    def _fire_windows(self, w_out: int, windows: Windows, pieces: DataFrame, store: dict) -> Fired:
        """Tumbling and sliding windows: a window is due the first time ``end <= W_out`` (``end`` in
        ``(W_in, W_out]``), and when this batch corrects it (``end <= W_in``, within lateness). A fired
        window is in the sink iff its value before this batch satisfied ``having``."""
        job, w_in = self.job, self.watermark_in_ms
        lateness, size = job.watermark.allowed_lateness_ms, job.window.size_ms
        lo, hi = w_in - lateness - size + 1, w_out - size  # window starts of every window that may be due
        every = job.window.every_ms
        if lo + (-lo) % every > hi:  # no window starts there (starts are multiples of the slide): none due
            return Fired(store=store)
        store["pieces"] = pieces = self.cache(pieces)  # read by the store's write and by the firing, concurrently
        in_range = (as_param(F.col(WS)) >= param(lo)) & (as_param(F.col(WS)) <= param(hi))
        now = pieces.where(in_range).withColumn("_now", F.lit(True))
        earlier = self.store.in_range("pieces", lo, hi) if self.store is not None else None
        both = now if earlier is None else earlier.withColumn("_now", F.lit(False)).unionByName(now)
        passing = windows.passing()
        merged = windows.merge(both, [F.max("_now").alias("_now")])
        first = as_param(F.col(WE)) > param(w_in)
        if not job.upserts:
            return Fired(rows=windows.sink_rows(merged.where(first & passing)), store=store)
        corrected = ~first & F.col("_now")
        due = merged.where(first | corrected)
        written = windows.sink_rows(due.where(passing)).withColumn(OP, F.lit("upsert"))
        if earlier is None or not job.having:
            return Fired(rows=written, store=store)
        before = windows.merge(earlier).where(passing).select(*job.keys, WS).withColumn("_was", F.lit(True))
        left = due.where(corrected & ~passing).join(before, [*job.keys, WS], "inner")
        return Fired(rows=written.unionByName(windows.deletes(left)), store=store)

    def _fire_sessions(self, w_out: int, windows: Windows, pieces: DataFrame, store: dict) -> Fired:
        """Sessions: the keys with pieces in this batch or with a session that may close now are
        re-merged from all their pieces; a session is due when ``end <= W_out`` and it differs from
        its last evaluation (``evals``). Rows of the sessions it absorbed that are in the sink are
        deleted; the evaluation is remembered, the absorbed ones are marked gone."""
        job, w_in, lateness = self.job, self.watermark_in_ms, self.job.watermark.allowed_lateness_ms
        keys, aggs = list(job.keys), windows.aggs
        earlier = self.store.every("pieces") if self.store is not None else None
        candidates = pieces.select(*keys)
        if earlier is not None:
            closing = earlier.where((as_param(F.col(WE)) > param(w_in)) & (as_param(F.col(WE)) <= param(w_out)))
            candidates = candidates.unionByName(closing.select(*keys))
            # their sessions before this batch, as pieces; those closed for good (end + L <= W_in) are gone
            before = windows.merge(earlier.join(candidates.distinct(), keys, "left_semi"))
            pieces = before.where(as_param(F.col(WE) + F.lit(lateness)) > param(w_in)).unionByName(pieces)
        sessions = windows.merge(pieces).where(as_param(F.col(WE)) <= param(w_out))
        evals = self.latest_evals()
        if evals is None:
            judged = sessions.select("*", F.lit(False).alias("_unchanged"), F.array().cast("array<bigint>").alias("_in_sink"),
                                     F.array().cast("array<bigint>").alias("_absorbed"))
        else:
            e = evals.select(*[F.col(k).alias(f"_e_{k}") for k in keys], F.col(WS).alias("_e_ws"),
                             F.col(WE).alias("_e_we"), *[F.col(a).alias(f"_e_{a}") for a in aggs],
                             F.col("passing").alias("_e_passing"))
            inside = F.lit(True)
            for k in keys:
                inside = inside & (F.col(k) == F.col(f"_e_{k}"))
            inside = inside & (F.col("_e_ws") >= F.col(WS)) & (F.col("_e_ws") < F.col(WE))
            same = (F.col("_e_ws") == F.col(WS)) & (F.col("_e_we") == F.col(WE))
            for a in aggs:
                same = same & F.col(f"_e_{a}").eqNullSafe(F.col(a))
            judged = sessions.join(e, inside, "left").groupBy(*keys, WS, WE).agg(
                *[F.first(a).alias(a) for a in aggs],
                F.max(F.coalesce(same, F.lit(False))).alias("_unchanged"),
                F.collect_list(F.when(F.col("_e_passing"), F.col("_e_ws"))).alias("_in_sink"),
                F.collect_list(F.when(F.col("_e_ws") != F.col(WS), F.col("_e_ws"))).alias("_absorbed"),
            )
        due = self.cache(judged.where(~F.col("_unchanged")).withColumn("_passing", windows.passing()))
        written = windows.sink_rows(due.where(F.col("_passing")))
        if job.upserts:
            retract = due.select(*keys, F.explode(F.filter("_in_sink", lambda s: (s != F.col(WS)) | ~F.col("_passing")))
                                 .alias(WS))
            rows = written.withColumn(OP, F.lit("upsert")).unionByName(windows.deletes(retract))
        else:
            rows = written
        batch = F.lit(self.batch_id).cast("long").alias("_batch")
        evaluated = due.select(*keys, WS, WE, *aggs, F.col("_passing").alias("passing"), F.lit(False).alias("_gone"), batch)
        gone = due.select(*keys, F.explode("_absorbed").alias(WS)).select(
            *keys, WS, F.lit(None).cast("long").alias(WE), *[F.lit(None).cast(windows.types[a]).alias(a) for a in aggs],
            F.lit(None).cast("boolean").alias("passing"), F.lit(True).alias("_gone"), batch)
        store["evals"] = evaluated.unionByName(gone)
        return Fired(rows=rows, store=store)

    def latest_evals(self) -> DataFrame | None:
        """The newest evaluation of each session start still remembered (gone ones dropped)."""
        if self.store is None:
            return None
        evals = self.store.every("evals")
        if evals is None:
            return None
        newest = Window.partitionBy(*self.job.keys, WS).orderBy(F.col("_batch").desc())
        return evals.withColumn("_r", F.row_number().over(newest)).where((F.col("_r") == 1) & ~F.col("_gone")).drop("_r")

    def release(self) -> None:
        for frame in self._cached:
            frame.unpersist()
        self._cached.clear()

    def cache(self, frame: DataFrame) -> DataFrame:
        """Keep ``frame`` until :meth:`release` (it is read more than once); returns it as its cache alone
        (see ``spark.jvm.cached_leaf``)."""
        return cached_leaf(self._cache(frame))

    def _cache(self, frame: DataFrame) -> DataFrame:
        if frame not in self._cached:
            frame.persist(StorageLevel.MEMORY_AND_DISK)
            self._cached.append(frame)
        return frame


def plan_batch(
    job: WindowedJob,
    raw: DataFrame,
    *,
    watermark_in_ms: int = NEG_INF_MS,
    store: Store | None = None,
    bounded: bool = False,
    event_range_ms: tuple[int, int] | None = None,
    batch_id: int = 0,
    lines_before: int | None = None,
) -> WindowedBatch:
    """Build the batch's frames from raw lines (``value``, ``source_file`` and, multi-source, ``_source``).
    ``lines_before``: a stream's previous batch's lines (a batch after a large one is expected to be large)."""
    parsed = parse_sources(job, raw, barrier=False)  # (cached before any filter: see ``WindowedBatch._lines``)
    # Only quarantined and late rows report their file. Dropping it elsewhere keeps the batch's
    # cache small: an uncompressed path string per event costs more than all its fields together.
    # (An event is late only for a window that ended before W_in, so its event time is before W_in.)
    needs_file = F.col("_reason").isNotNull()
    if not bounded:
        needs_file = needs_file | (as_param(F.unix_millis(F.col(job.source.event_time))) < param(watermark_in_ms))
    parsed = parsed.withColumn("source_file", F.when(needs_file, F.col("source_file")))
    if bounded:  # the lines are cached: keep only the fields the transform reads (a stream's late rows need all)
        parsed = select(parsed, once("bounded columns", lambda: [F.col(c) for c in _bounded_columns(job, parsed)], job))
    return WindowedBatch(job=job, watermark_in_ms=watermark_in_ms, bounded=bounded, parsed=parsed, store=store,
                         event_range_ms=event_range_ms, batch_id=batch_id, expect_large=not bounded and (lines_before or 0) > INTERPRETED_BATCH_LINES)


def _expired(job: WindowedJob, f: StoreFile, watermark_ms: int) -> bool:
    """Whether every row of a store file has expired at ``watermark_ms`` (ids: every id forgotten;
    pieces of tumbling/sliding windows: every window closed beyond lateness)."""
    if f.kind == "ids":
        return f.expires_ms <= watermark_ms
    return not isinstance(job.window, Session) and f.expires_ms + job.watermark.allowed_lateness_ms <= watermark_ms


@dataclass
class Compaction:
    """Files that replace others in the store (see :func:`compact`)."""

    made: list[StoreFile] = field(default_factory=list)
    replaced: list[StoreFile] = field(default_factory=list)


def compaction_due(job: WindowedJob, store: Store, watermark_ms: int) -> dict[str, list[StoreFile]]:
    """The files to merge, by kind: once a kind has ``COMPACT_EVERY`` live files (ids: of single batches;
    pieces and session evaluations together)."""
    keep = [f for f in store.manifest.files if not _expired(job, f, watermark_ms)]
    due: dict[str, list[StoreFile]] = {}
    ids = [f for f in keep if f.kind == "ids" and not f.path.rsplit("/", 2)[-2].startswith("c")  # per-batch files
           and f.bucket_ms == BUCKET_MS]  # (files with wider buckets are left to expire)
    if len(ids) >= COMPACT_EVERY:
        due["ids"] = ids
    pieces = [f for f in keep if f.kind == "pieces"]
    evals = [f for f in keep if f.kind == "evals"]
    if pieces and (len(pieces) >= COMPACT_EVERY or len(evals) >= COMPACT_EVERY):
        due["pieces"] = pieces
        if evals:
            due["evals"] = evals
    return due


def compact(job: WindowedJob, store: Store, batch_id: int, watermark_ms: int, types: dict[str, T.DataType],
            due: dict[str, list[StoreFile]]) -> Compaction:
    """Merge the files ``due`` (see :func:`compaction_due`) into one per kind (sessions: re-merged, closed
    ones dropped; rows expired at ``watermark_ms`` — the batch's incoming watermark — left out). It reads
    nothing the batch writes, so it runs alongside the batch, off its critical path; the batch's
    manifest swaps the files at the end."""
    lateness = job.watermark.allowed_lateness_ms
    merged: dict[str, DataFrame] = {}
    if "ids" in due:
        merged["ids"] = store._read("ids", due["ids"]).where(as_param(F.col("_expires_ms")) > param(watermark_ms))  # noqa: SLF001
    if "pieces" in due:
        windows = Windows(job, types)
        open_windows = windows.merge(store._read("pieces", due["pieces"]))  # noqa: SLF001
        open_windows = open_windows.where(as_param(F.col(WE) + F.lit(lateness)) > param(watermark_ms))
        merged["pieces"] = open_windows
        if "evals" in due:
            latest = Window.partitionBy(*job.keys, WS).orderBy(F.col("_batch").desc())
            recent = store._read("evals", due["evals"]).withColumn("_r", F.row_number().over(latest))  # noqa: SLF001
            recent = recent.where((F.col("_r") == 1) & ~F.col("_gone")).drop("_r")
            spans = open_windows.select(*[F.col(k).alias(f"_s_{k}") for k in job.keys], F.col(WS).alias("_s_ws"),
                                        F.col(WE).alias("_s_we"))
            inside = F.lit(True)
            for k in job.keys:
                inside = inside & (F.col(k) == F.col(f"_s_{k}"))
            inside = inside & (F.col(WS) >= F.col("_s_ws")) & (F.col(WS) < F.col("_s_we"))
            merged["evals"] = recent.join(spans, inside, "left_semi")
    made = store.write(batch_id, merged, folder=f"{store.layout.store}/c{batch_id}")
    return Compaction(made, [f for files in due.values() for f in files])


def maintain(job: WindowedJob, store: Store, new_files: list[StoreFile], compaction: Compaction,
             watermark_out_ms: int) -> tuple[Manifest, list[str]]:
    """The store after a batch: its new files and the compaction's in place of the files they replace,
    files whose rows have all expired at ``W_out`` dropped. Returns the new manifest and the folders to
    delete once no replay can need them."""
    files = [*store.manifest.files, *new_files, *compaction.made]
    gone = {f.path for f in compaction.replaced}
    keep = [f for f in files if f.path not in gone and not _expired(job, f, watermark_out_ms)]
    live = {f.path for f in keep}
    removed = [f.path for f in files if f.path not in live]
    bases = {f.path.rsplit("/", 1)[0] for f in keep}
    removed += sorted({p.rsplit("/", 1)[0] for p in removed} - bases)
    return Manifest(keep), removed
