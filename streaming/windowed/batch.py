"""The event-time engine of windowed jobs: one micro-batch of a stream, or one bounded run.

The same code serves the stream (inside ``foreachBatch``: earlier batches reach it through the
incremental ``store``) and the bounded twin (one call, nothing before it, a perfect watermark). It
builds DataFrames; the handlers and runners do the I/O.

Per batch, with ``W_in`` the watermark at its start, ``d`` the out-of-orderness and ``L`` the allowed
lateness (see ``declaration`` for the rules):

1. parse the lines of every source; invalid ones become quarantine rows (per file and line text);
2. drop repeated deliveries of an id, whatever their event times: within the batch the first to arrive
   counts (``_arrival``: its file's modification time, then its place in the file), and an id
   remembered from earlier batches counts no more (an id is remembered until
   ``max(event time, W_in) + dedup_ttl <= W``; looked up in the executors' index, ``checkpoint.seen``);
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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal

import numpy as np
import pyarrow as pa
from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, Observation
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.window import Window

from ..checkpoint.records import BatchStats
from ..checkpoint.seen import SEEN_SCHEMA, lookup, remembered_on_driver
from ..checkpoint.store import BUCKET_MS, IDS_SCHEMA, Store, StoreFile, bucket_of, id_hashes
from ..declaration import WindowedJob
from ..errors import DeclarationError
from ..io.parse import ARRIVAL, parse_sources
from ..spark.carried import FILE, transformed_carrying
from ..spark.columns import as_param, group, in_set, once, param, select
from ..spark.jvm import cached_leaf, collect_arrow, estimated_bytes, plan_now, referenced_columns
from ..spark.metrics import observe, observed, packed
from ..time import NEG_INF_MS, POS_INF_MS, advance
from ..windows import WE, WS, Fired, Firing
from ..io.schemas import types_of
from .aggregates import Aggregates


# A stream's batch (of more than ``INTERPRETED_BATCH_LINES``) with at most this many ids delivered more
# than once drops the repeats by a filter (see ``WindowedBatch.repeats``); their hashes reach the driver
# (24 bytes each).
MAX_REPEATS = 10_000
# A stream's batch whose input size is not known (a table source) and is not expected to be large, with at most this many
# valid lines, has its ids aggregated into one row of the statistics job (32 bytes each), and the driver finds the repeats
# and looks them up (see ``WindowedBatch._stats_and_ids``).
DRIVER_LOOKUP_LINES = 100_000
# A batch whose input Spark estimates at no more than this (~2.7M payment lines of ~190 bytes, ~110 MB on the driver)
# brings every valid line's id hashes, arrival and line number to the driver as Arrow in its statistics job (40 bytes
# a line), and the driver finds its repeats with numpy; a large first batch of a stream also writes the ids it
# remembers from there. Under the latency feed a batch's parse and statistics took 0.115-0.118 s this way against
# 0.127-0.133 s with the ids aggregated into one row (medians of 3 alternated runs). A bounded run's count job brings
# them too (32 bytes each). A larger batch finds its repeats by a hash aggregate (a stream) or a shuffle (a bounded
# run) on the executors.
DRIVER_LOOKUP_BYTES = 512_000_000
KEPT = "_kept"  # in the ids file a large batch's statistics job writes: the line kept of an id delivered more than once
TAG = "_line"  # a line's number within its batch (see ``WindowedBatch._tagged``)
# A delivery's place in the arrival order, then in the batch, as one number an aggregate can take the least of
# without sorting: ``arrival * 10^19 + line`` (both are longs >= 0, so below 10^19) as a decimal(38, 0), which
# Spark's hash aggregate keeps in a fixed-width buffer. ``min(struct(arrival, line))`` made it a sort-based
# aggregate, which sorted every line of the batch by id (a stream's 1M-line batch: ~3.6 s of CPU more).
_ORDER = T.DecimalType(38, 0)
_LINE_SPAN = 10 ** 19


def first_delivery_order() -> Column:
    return F.col(ARRIVAL).cast(_ORDER) * F.lit(Decimal(_LINE_SPAN)).cast(_ORDER) + F.col(TAG).cast(_ORDER)


def line_of_order(order: Column) -> Column:
    """The line of :func:`first_delivery_order`'s number."""
    return (order % F.lit(Decimal(_LINE_SPAN)).cast(_ORDER)).cast("long")


def _repeat_groups(h1: np.ndarray, h2: np.ndarray, arrival: np.ndarray, line: np.ndarray):
    """The lines that may be repeats, in order of id, then arrival, then line: (their hashes, their line numbers,
    whether each starts its id's lines); None when no id is delivered more than once."""
    if not len(h1):
        return None
    # (only the lines whose first hash is repeated can be repeats: found by one sort of that hash, ~20x faster than
    # ordering every line by all four keys)
    by_h1 = np.argsort(h1)
    same = h1[by_h1][1:] == h1[by_h1][:-1]
    if not same.any():
        return None
    maybe = np.zeros(len(h1), dtype=bool)
    maybe[1:] |= same
    maybe[:-1] |= same
    maybe = by_h1[maybe]
    h1, h2, arrival, line = h1[maybe], h2[maybe], arrival[maybe], line[maybe]
    order = np.lexsort((line, arrival, h2, h1))
    s1, s2 = h1[order], h2[order]
    return s1, s2, line[order], np.concatenate(([True], (s1[1:] != s1[:-1]) | (s2[1:] != s2[:-1])))


def first_deliveries(h1: np.ndarray, h2: np.ndarray, arrival: np.ndarray, line: np.ndarray
                     ) -> tuple[list[int], list[int], list[int]] | None:
    """Of a batch's valid lines (their id hashes, arrival and line number), the ids delivered more than once: their
    hashes and the line kept of each, the first to arrive (then the first in the batch); None when more than
    ``MAX_REPEATS`` (see ``WindowedBatch.repeats``)."""
    groups = _repeat_groups(h1, h2, arrival, line)
    if groups is None:
        return [], [], []
    s1, s2, lines, starts = groups
    first = np.flatnonzero(starts)
    first = first[np.diff(np.append(first, len(starts))) > 1]
    return _repeated(s1[first], s2[first], lines[first])


def later_deliveries(h1: np.ndarray, h2: np.ndarray, arrival: np.ndarray, line: np.ndarray) -> np.ndarray:
    """Of a batch's valid lines (as :func:`first_deliveries` takes them), the line numbers of every delivery of an id
    but its first: the lines a dedup drops."""
    groups = _repeat_groups(h1, h2, arrival, line)
    return np.empty(0, np.int64) if groups is None else groups[2][~groups[3]]


def _repeated(h1: np.ndarray, h2: np.ndarray, kept: np.ndarray) -> tuple[list[int], list[int], list[int]] | None:
    """The repeated ids found on the driver as :meth:`WindowedBatch.repeats` gives them: None past ``MAX_REPEATS``."""
    if len(h1) > MAX_REPEATS:
        return None
    return h1.tolist(), h2.tolist(), kept.tolist()


def _check_transform_output(job: WindowedJob, columns: list[str]) -> bool:
    needed = (*job.keys, job.source.event_time, job.source.dedup_key)
    missing = [c for c in needed if c not in columns]
    if missing:
        raise DeclarationError(
            f"job {job.name}: transform output lacks column(s) {missing}; it must keep the keys, the "
            "event-time column and the dedup key"
        )
    return True


def transform_inputs(job, schema: T.StructType) -> set[str]:
    """The columns of ``schema`` that ``job.transform`` reads or passes on: found by optimising the
    transform over an empty frame Spark cannot see is empty (column pruning leaves what it needs)."""
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    out = job.transform(spark.createDataFrame(spark.sparkContext.emptyRDD(), schema))
    return referenced_columns(out) & set(schema.names)


def _bounded_columns(job: WindowedJob, parsed: DataFrame) -> list[str]:
    engine = {"source", "source_file", "_raw", "_reason", ARRIVAL, job.source.event_time, job.source.dedup_key, *job.keys}
    needed = transform_inputs(job, parsed.schema) | engine
    return [c for c in parsed.columns if c in needed]


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
_IDS_ARROW = pa.schema([(f.name, pa.int64()) for f in IDS_SCHEMA.fields])
_NO_TIME = np.iinfo(np.int64).min  # a valid line without an event time, among the ids the statistics bring
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
    # A stream's batch whose input Spark estimates at no more than ``DRIVER_LOOKUP_BYTES``: its statistics job brings
    # every id to the driver (see :meth:`_repeats_and_remembered`). A bounded run of no more than
    # ``DRIVER_LOOKUP_BYTES``: its count job does (see :meth:`_bounded_repeats`).
    ids_to_driver: bool = False
    _stats: BatchStats | None = None
    _min_t: int | None = None
    _late_candidates: int = 0
    _events: DataFrame | None = None
    _repeats: tuple[list[int], list[int], list[int]] | None | object = _UNKNOWN
    _remembered_found: tuple[list[int], list[int]] | None = None  # remembered ids found by the statistics job (``_h1``, ``_h2``)
    _batch_ids: np.ndarray | None = None  # the valid lines' hashes, arrival, line and event time (``_stats_and_ids``)
    _dropped_lines: list[int] | None = None  # a bounded run's later deliveries of an id, found by its count job (``count``)
    # The ids the batch remembers, as the store file its statistics job wrote (``_repeats_and_ids``; None: no valid line)
    _written_ids: StoreFile | None | object = _UNKNOWN
    _observation: Observation | None = None
    _counting: Future | None = None  # bounded: the lines' count, running (see :meth:`count`)
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
        return once("valid", lambda: F.col("_reason").isNull())

    def _in_range(self) -> Column:
        """Valid and, bounded, in the range of event times the run needs (``event_range_ms``)."""
        valid = self._valid()
        if self.event_range_ms is None:
            return valid
        t_ms = F.unix_millis(self.job.source.event_time)
        return valid & (t_ms >= self.event_range_ms[0]) & (t_ms < self.event_range_ms[1])

    def _stat_columns(self) -> list[Column]:
        if self.bounded:
            return self._build_stat_columns() if self.event_range_ms is not None else \
                once("stat columns", self._build_stat_columns, self.job)
        # a stream's batch also counts the events that can be late (see ``late_horizon_ms``)
        t_ms = once("event ms", lambda: as_param(F.unix_millis(self.job.source.event_time)), self.job)
        early = F.count(F.when(self._valid() & (t_ms < param(self.late_horizon_ms())), 1)).alias("_early")
        return [*once("stat columns", self._build_stat_columns, self.job), early]

    def _build_stat_columns(self) -> list[Column]:
        job, valid = self.job, self._in_range()
        t_ms = F.unix_millis(job.source.event_time)
        bad = [F.count(F.when(F.col("_reason").isNotNull() & (F.col("source") == s.name), 1)).alias(s.name)
               for s in job.sources]
        return [F.count(F.lit(1)).alias("_lines"), F.count(F.when(valid, 1)).alias("_valid"),
                F.max(F.when(valid, t_ms)).alias("_max_t"), F.min(F.when(valid, t_ms)).alias("_min_t"), *bad]

    def _cached_lines(self) -> DataFrame:
        """Every parsed line, cached (a stream's: as the cache alone, see ``spark.jvm.cached_leaf``)."""
        self._cache(self.parsed)
        if self.bounded:
            return self.parsed
        if self._leaf is None:
            self._leaf = cached_leaf(self.parsed)
        return self._leaf

    def _lines(self) -> DataFrame:
        """Every parsed line, cached. Bounded: also counted on the way (the firing's pass reads them all), unless
        :meth:`count` counted them first."""
        lines = self._cached_lines()
        if not self.bounded or self._counting is not None:
            return lines
        if self._lines_seen is None:
            self._lines_seen = Observation(f"lines-{self.job.name}-{next(_OBSERVATIONS)}")
            self._observed_lines = observe(self.parsed, self._lines_seen, self._stat_columns())
        return self._observed_lines

    def count(self) -> None:
        """Bounded: count the lines in a job of their own, started now on another thread (:meth:`stats` waits for
        it), which also fills their cache; call it before :meth:`fire`. The driver builds the firing's plans
        meanwhile, and the lines' other readers (the quarantine) need not wait for the firing's pass. With
        ``ids_to_driver`` the same job brings every valid line's id hashes and arrival, and the driver finds the ids
        delivered more than once (see :meth:`_bounded_repeats`)."""
        assert self.bounded and self._lines_seen is None, "count() is for a bounded run, before its firing is built"
        spark = self.parsed.sparkSession
        if self.ids_to_driver:
            seen = Observation(f"count-{self.job.name}-{next(_OBSERVATIONS)}")
            counts = self._line_ids(observe(self._cached_lines(), seen, packed(self._stat_columns())), with_time=False)
        else:
            counts = self._cached_lines().agg(*self._stat_columns())
        adaptive = spark.conf.get("spark.sql.adaptive.enabled", None)
        # Planned here, without adaptive execution (which would fill the cache in a job of its own and read it
        # again for the counts); the plan is kept by the frame, so the thread runs it as planned.
        spark.conf.set("spark.sql.adaptive.enabled", "false")
        try:
            plan_now(counts)
        finally:
            if adaptive is None:
                spark.conf.unset("spark.sql.adaptive.enabled")
            else:
                spark.conf.set("spark.sql.adaptive.enabled", adaptive)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"count-{self.job.name}")
        if self.ids_to_driver:
            self._counting = pool.submit(self._bounded_repeats, counts, seen)
        else:
            self._counting = pool.submit(lambda: counts.collect()[0])
        pool.shutdown(wait=False)

    def _bounded_repeats(self, ids: DataFrame, seen: Observation):
        """The count job of a bounded run whose ids come to the driver: it brings every valid line's id hashes,
        arrival and line number (32 bytes a line, as Arrow), from which the driver finds the later deliveries of
        each id (:func:`later_deliveries`); the events are then the cached lines without those, filtered where they
        are, with no shuffle and sort of every event by its id (more than ``MAX_REPEATS`` of them: the shuffle).
        Returns the statistics."""
        lines = self._collect_line_ids(ids, 4)
        row = observed(seen)
        dropped = later_deliveries(*lines.T)
        self._dropped_lines = dropped.tolist() if len(dropped) <= MAX_REPEATS else None
        return row

    def stats(self) -> BatchStats:
        """The batch's statistics. Bounded: call it after :meth:`count`, or after an action over :meth:`fire`'s
        rows has run."""
        if self._stats is None:
            job = self.job
            if self._counting is not None:
                row = self._counting.result()
            elif self.bounded:
                row = observed(self._lines_seen)
            elif self.expect_large or self.ids_to_driver:
                seen = Observation(f"stats-{job.name}-{next(_OBSERVATIONS)}")
                lines = observe(self._lines(), seen, packed(self._stat_columns()))
                if self.ids_to_driver:
                    self._repeats_and_remembered(lines)
                elif self._writes_ids():
                    self._repeats_and_ids(lines)
                else:
                    self._repeats = self._find_repeats(lines)
                row = observed(seen)
            else:
                row = self._stats_and_ids()
            self._set_stats(row)
        return self._stats

    def _set_stats(self, row) -> None:
        self.quarantined_by_source = {s.name: row[s.name] for s in self.job.sources}
        self._stats = BatchStats(lines=row["_lines"], quarantined=sum(self.quarantined_by_source.values()),
                                 events=row["_valid"], max_event_time_ms=row["_max_t"],
                                 watermark_in_ms=self.watermark_in_ms)
        self._min_t = row["_min_t"]
        self._late_candidates = int(row["_early"] or 0) if not self.bounded else 0

    def late_candidates(self) -> int:
        """A stream's batch: its valid lines before :meth:`late_horizon_ms` (repeats included)."""
        self.stats()
        return self._late_candidates

    def next_watermark(self) -> int:
        if self.bounded:
            return POS_INF_MS
        return advance(self.watermark_in_ms, self.stats().max_event_time_ms, self.job.watermark.out_of_orderness_ms)

    # -- outputs ---------------------------------------------------------------------------
    def quarantine(self, source: str | None = None, written_by: str | None = None, batch_id: int | None = None) -> DataFrame:
        """Invalid lines (of ``source``, or all), one row per (file, line text) with its count, and the commit
        that writes them (``written_by``, ``batch_id``: see ``io.schemas.QUARANTINE_SCHEMA``)."""
        lines = self._cached_lines()
        where, keys, values, columns = once(("quarantine", source), lambda: (
            F.col("_reason").isNotNull() & (F.lit(True) if source is None else F.col("source") == source),
            [F.col("source"), F.col("source_file"), F.col("_raw").alias("raw_line")],
            [F.first("_reason").alias("reason"), F.count(F.lit(1)).alias("occurrences")],
            [F.col(c) for c in ("source", "source_file", "raw_line", "reason", "occurrences")]
            + [F.lit(self.job.name).alias("detected_by")],
        ), self.job)
        rows = select(group(lines.where(where), keys, values), columns)
        return rows.select("*", F.lit(written_by).cast("string").alias("written_by"),
                           F.lit(batch_id).cast("long").alias("batch_id"))

    def events(self) -> DataFrame:
        """Valid events, each id once: of its deliveries in the batch the first to arrive, and none of an
        id the stream remembers, whatever the event times. Bounded: every delivery read counts for that,
        in the range of event times or not (the first delivery of an id decides its window); the range
        applies after. See :meth:`repeats` for how repeats within a stream's batch go."""
        if self._events is None:
            if not self.bounded:
                self.stats()
            job = self.job
            key = job.source.dedup_key
            if self.bounded and self.ids_to_driver:
                self.stats()  # (the count job found the lines to drop)
                dropped = self._dropped_lines
                repeats = None if dropped is None else ([], [], [])
            else:
                dropped = None
                known = self._repeats is not _UNKNOWN
                repeats = self.repeats() if not self.bounded and (known or self.stats().events > INTERPRETED_BATCH_LINES) else None
            added = once("event columns", lambda: [
                F.col("*"), F.unix_millis(job.source.event_time).alias("event_time_ms"), *id_hashes(F.col(key))], job)
            events = select(self._tagged(), added)
            if repeats is None:  # the first delivery of each id by a shuffle: the bounded run's, or too many repeats
                first = once("first delivery", lambda: F.row_number().over(
                    Window.partitionBy(key).orderBy(F.col(ARRIVAL), F.col(TAG))).alias("_nth"), job)
                events = events.select("*", first).where(F.col("_nth") == 1).drop("_nth")
            elif dropped:
                events = events.where(~in_set(TAG, dropped))
            elif repeats[0]:
                h1, h2, kept = (in_set(c, v) for c, v in zip(("_h1", "_h2", TAG), repeats))
                events = events.where(~(h1 & h2) | kept)
            events = events.drop(TAG, ARRIVAL, "_raw", "_reason")
            if self.event_range_ms is not None:
                lo, hi = self.event_range_ms
                events = events.where((F.col("event_time_ms") >= lo) & (F.col("event_time_ms") < hi))
            found = self._remembered_found  # (by the statistics job: a filter where the events are)
            remembered = self._remembered(events) if found is None else None
            if found is not None and found[0]:
                events = events.where(~(in_set("_h1", found[0]) & in_set("_h2", found[1])))
            if remembered is not None:
                events = events.join(F.broadcast(remembered), ["_h1", "_h2"], "left_anti")
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

    def _remembered(self, events: DataFrame) -> DataFrame | None:
        """The batch's ids that earlier batches counted and that are not forgotten at ``W_in`` (a stream's
        batch with a store that has ids): looked up on the executors (``checkpoint.seen``)."""
        if self.bounded or self.store is None:
            return None
        if not self.store.id_files():
            return None
        return events.select("_h1", "_h2").mapInPandas(self._lookup(), SEEN_SCHEMA)

    def _lookup(self):
        """The executors' lookup of ids in the store's live ids files (``checkpoint.seen``)."""
        return lookup(self.store.layout.store, self.store.id_files(), self.watermark_in_ms, self.store.storage_options)

    def _repeats_and_remembered(self, lines: DataFrame) -> None:
        """A stream's batch of no more than ``DRIVER_LOOKUP_BYTES`` of input: the statistics job
        brings every valid line's id hashes, arrival, line number and event time (40 bytes a line, as Arrow, with no
        aggregate and no shuffle), and the driver finds both the repeated ids and the remembered ones, as
        :meth:`_stats_and_ids` does for a batch of ordinary size, and writes the ids the batch remembers
        (:meth:`new_ids`): no lookup job, no cache of the events, no Spark job for the ids. The default stream's one
        batch of 1M payments: its statistics ~2 s shorter than with the ids aggregated by hash in the same job."""
        ids = self._collect_line_ids(self._line_ids(lines, with_time=True), 5)
        h1, h2 = ids[:, 0], ids[:, 1]
        self._repeats = first_deliveries(h1, h2, ids[:, 2], ids[:, 3])
        if self.store is not None and self.store.id_files():
            self._remembered_by_driver(h1, h2)
        self._batch_ids = ids

    def _line_ids(self, lines: DataFrame, with_time: bool) -> DataFrame:
        """The valid lines among ``lines`` (the cached lines, or a frame passing them through in order) as their
        id hashes, arrival and line number (``TAG``), and with ``with_time`` their event time (``_NO_TIME`` for none)."""
        job = self.job
        key, event_time = job.source.dedup_key, job.source.event_time
        columns = once(("line ids", with_time), lambda: [
            *id_hashes(F.col(key)), F.col(ARRIVAL), F.col(TAG),
            *([F.coalesce(F.unix_millis(F.col(event_time)), F.lit(_NO_TIME)).alias("_t")] if with_time else [])], job)
        return select(self._tagged(lines), columns)

    @staticmethod
    def _collect_line_ids(frame: DataFrame, width: int) -> np.ndarray:
        """:meth:`_line_ids`' rows on the driver, as one array of longs (a row per line)."""
        got = collect_arrow(frame)
        if not got:
            return np.empty((0, width), np.int64)
        table = pa.Table.from_batches(got)
        return np.column_stack([table.column(i).to_numpy().astype(np.int64, copy=False) for i in range(width)])

    def _writes_ids(self) -> bool:
        """Whether the statistics job of a large batch writes the ids it remembers (:meth:`_repeats_and_ids`): a
        stream's batch whose store remembers no ids (its first batch, or one after every id expired)."""
        return not self.bounded and self.event_range_ms is None and self.store is not None \
            and not self.store.id_files()

    def _repeats_and_ids(self, lines: DataFrame) -> None:
        """A large batch that no remembered id can concern: its statistics job aggregates its lines by id (as
        :meth:`_find_repeats` does) and writes that aggregate as the store's new ids file, one row per id with its
        first delivery's event time, and the line kept of each id delivered more than once (NULL otherwise); the
        driver then reads those lines back. No pass over the cached lines for the ids, and no second hashing. (A batch
        with remembered ids keeps the other path: written again, a remembered id would be forgotten later.) The default
        stream's one batch of 1M payments: its outputs' commits ~3.1 s against ~5.7 s, its statistics ~1 s longer;
        whole processes 0.91 and 0.99 of the wall time in two sets of alternated pairs on Iceberg, 1.01 on Delta."""
        t = F.when(F.col("_t") != F.lit(_NO_TIME), F.col("_t"))
        expires = F.greatest(as_param(t), param(self.watermark_in_ms)).cast("long") + F.lit(self.ttl_ms)
        ids = self._repeats_frame(lines, every=True).select(
            bucket_of(t).alias("_b"), "_h1", "_h2", expires.alias("_expires_ms"),
            F.when(F.col("_n") > 1, F.col("_kept")).alias(KEPT))
        self._written_ids, self._repeats = self.store.write_ids_now(self.batch_id, ids, KEPT, MAX_REPEATS)

    def _remembered_by_driver(self, h1: np.ndarray, h2: np.ndarray) -> None:
        """The driver's lookup of the batch's ids (``seen.remembered_on_driver``): the remembered ones, to filter the
        events by; left unknown when more than ``MAX_REPEATS`` (the events join the executors' lookup instead)."""
        found = remembered_on_driver(self.store.layout.store, self.store.id_files(), self.watermark_in_ms,
                                     self.store.storage_options, h1, h2)
        if int(found.sum()) <= MAX_REPEATS:
            self._remembered_found = (h1[found].tolist(), h2[found].tolist())

    def _stats_and_ids(self):
        """A stream's batch whose input size Spark does not know (a table source) or whose ids do not come as Arrow
        (see ``DRIVER_LOOKUP_BYTES``), not expected to be large: the statistics job also brings each valid line's id hashes, arrival,
        line number and event time (40 bytes a line, up to ``DRIVER_LOOKUP_LINES`` lines), and the driver finds the ids
        delivered more than once (:func:`first_deliveries`) and, with a store of remembered ids, looks the ids
        up in its own index of them (``checkpoint.seen``, as the executors' lookup does). One job of the JVM alone:
        the events are then the cached lines filtered where they are, read again by each output, with no
        shuffle and sort of every event by its id and no cache of them (whose eager planning alone took ~0.15 s
        of the driver's time per batch under the latency feed); the ids the batch remembers are written from the
        driver (:meth:`new_ids`). A batch with more valid lines brings no ids: it finds its repeats in a job of its
        own (:meth:`repeats`), and its events join the executors' lookup."""
        job = self.job
        ids = once("batch ids", lambda: [F.when(F.count(F.when(self._valid(), 1)) <= F.lit(DRIVER_LOOKUP_LINES), F.flatten(
            F.collect_list(F.when(self._valid(), F.array(*id_hashes(F.col(job.source.dedup_key)), F.col(ARRIVAL), F.col(TAG),
                                                          F.coalesce(F.unix_millis(job.source.event_time), F.lit(_NO_TIME)))))
        )).alias("_ids")], job)
        row = self._numbered(self._lines()).agg(*self._stat_columns(), *ids).first()
        flat = row["_ids"]
        if flat is not None:
            lines = np.asarray(flat, dtype=np.int64).reshape(-1, 5)
            h1, h2 = lines[:, 0], lines[:, 1]
            self._repeats = first_deliveries(h1, h2, lines[:, 2], lines[:, 3])
            if self.store is not None and self.store.id_files():
                self._remembered_by_driver(h1, h2)
            self._batch_ids = lines
        return row

    def repeats(self) -> tuple[list[int], list[int], list[int]] | None:
        """A stream's ids delivered more than once in the batch: their hashes ``_h1`` and ``_h2``, and the
        line kept of each (the first); None when there are too many to filter (each id's deliveries are then
        numbered in arrival order, a shuffle and sort of every event).

        Repeats are rare: this aggregates 24 bytes per line by hash, without sorting, and the events
        are then filtered where they are, without a shuffle. Numbering the deliveries shuffles whole rows
        and sorts them: in a stream of 50k-line batches that cost ~0.35 s per batch. A batch of ordinary
        size finds its repeats on the driver, from the ids its statistics job brings (:meth:`_stats_and_ids`);
        a batch expected to be large in its statistics job (see :meth:`stats`); a job of their own finds those
        of a batch of more than ``DRIVER_LOOKUP_LINES`` valid lines that was not expected to be large."""
        if self._repeats is _UNKNOWN:
            self._repeats = self._find_repeats(self._lines())
        return self._repeats  # type: ignore[return-value]

    def _repeats_frame(self, lines: DataFrame, every: bool = False) -> DataFrame:
        """The ids delivered more than once among ``lines`` (see :meth:`_tagged`): ``_h1``, ``_h2``, ``_kept`` (the
        line kept); ``every``: every id, with ``_n``, its deliveries, and ``_t``, its first delivery's event time."""
        key, event_time = self.job.source.dedup_key, self.job.source.event_time

        def build():
            hashes, kept = [F.col("_h1"), F.col("_h2")], line_of_order(F.col("_first")).alias("_kept")
            columns = [first_delivery_order().alias("_order"), *id_hashes(F.col(key))]
            aggregates = [F.count(F.lit(1)).alias("_n"), F.min("_order").alias("_first")]
            # every id: also its first delivery's event time (``_order`` is unique: a hash aggregate, deterministic)
            t = F.coalesce(F.unix_millis(F.col(event_time)), F.lit(_NO_TIME)).alias("_t")
            return (columns, hashes, aggregates, F.col("_n") > 1, [*hashes, kept], [*columns, t],
                    [*aggregates, F.min_by("_t", "_order").alias("_t")], [*hashes, F.col("_n"), kept, F.col("_t")])

        columns, keys, aggregates, repeated, out, every_columns, every_aggregates, every_out = \
            once("repeats", build, self.job)
        if every:
            return select(group(select(self._tagged(lines), every_columns), keys, every_aggregates), every_out)
        grouped = group(select(self._tagged(lines), columns), keys, aggregates)
        return select(grouped.where(repeated), out)

    def _find_repeats(self, lines: DataFrame) -> tuple[list[int], list[int], list[int]] | None:
        rows = self._repeats_frame(lines).limit(MAX_REPEATS + 1).collect()
        if len(rows) > MAX_REPEATS:
            return None
        return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]

    def _tagged(self, lines: DataFrame | None = None) -> DataFrame:
        """The valid lines with ``TAG``, each line's number in the batch: the same numbers every time (Spark
        numbers the rows of each partition of the cached lines in order; ``lines``: the cached lines, or a
        frame that passes each of their rows through in order, as the statistics' observation does). Every line
        is numbered, valid or not, so the statistics job, which counts them all, numbers them alike."""
        return self._numbered(self._lines() if lines is None else lines).where(self._valid())

    @staticmethod
    def _numbered(lines: DataFrame) -> DataFrame:
        return lines.withColumn(TAG, F.monotonically_increasing_id())

    def events_seen(self) -> int:
        """Bounded: the events the firing read (after an action over :meth:`fire`'s rows has run)."""
        return int(observed(self._observation)["n"] or 0)

    def new_ids(self) -> DataFrame | pa.Table:
        """The ids this batch brings, with when they are forgotten: ``max(event time, W_in) + dedup_ttl``. A batch
        whose statistics brought its ids finds them on the driver, as :meth:`events` filters them (an Arrow table:
        the store writes it without a Spark job); other batches as a frame over :meth:`events`."""
        if self._written_ids is not _UNKNOWN:
            return self._written_ids  # type: ignore[return-value]
        found = self._ids_on_driver()
        if found is not None:
            return found
        t, bucket, hashes = once("new ids", lambda: (
            F.col("event_time_ms"), bucket_of(F.col("event_time_ms")).alias("_b"), [F.col("_h1"), F.col("_h2")]))
        expires = F.greatest(as_param(t), param(self.watermark_in_ms)).cast("long") + F.lit(self.ttl_ms)
        return self.events().select(bucket, *hashes, expires.alias("_expires_ms"))

    def _ids_on_driver(self) -> pa.Table | None:
        """:meth:`new_ids` from the ids the statistics job brought (:meth:`_stats_and_ids`,
        :meth:`_repeats_and_remembered`), kept by the same tests as :meth:`events`
        applies to the lines: the first delivery of each repeated id (``repeats``), none that the store remembers
        (``_remembered_found``). None when the batch did not bring them or filters otherwise (too many repeats or
        remembered ids: a shuffle or the executors' lookup), or when a line has no event time."""
        lines, repeats = self._batch_ids, self._repeats
        if lines is None or self.bounded or self.event_range_ms is not None or repeats is None or repeats is _UNKNOWN:
            return None
        remembered = self._remembered_found
        if remembered is None and self.store is not None and self.store.id_files():
            return None
        h1, h2, tag, t = lines[:, 0], lines[:, 1], lines[:, 3], lines[:, 4]
        if (t == _NO_TIME).any():
            return None
        keep = np.ones(len(t), dtype=bool)
        if repeats[0]:  # (the frame's test: ``~(h1 in R1 & h2 in R2) | line in kept``)
            keep &= ~(np.isin(h1, repeats[0]) & np.isin(h2, repeats[1])) | np.isin(tag, repeats[2])
        if remembered is not None and remembered[0]:
            keep &= ~(np.isin(h1, remembered[0]) & np.isin(h2, remembered[1]))
        t = t[keep]
        expires = np.maximum(t, np.int64(self.watermark_in_ms)) + np.int64(self.ttl_ms)
        return pa.table([np.floor_divide(t, BUCKET_MS), h1[keep], h2[keep], expires], schema=_IDS_ARROW)

    def _late_condition(self, we: Column | None = None) -> Column:
        if self.bounded:
            return F.lit(False)
        we = F.col(WE) if we is None else we
        return as_param(we + F.lit(self.job.watermark.allowed_lateness_ms)) <= param(self.watermark_in_ms)

    def windowed(self) -> DataFrame:
        """Transformed events with their windows and a ``_late`` flag (one row per event and window). A stream's
        rows also carry what a late row keeps of the event as it arrived (:data:`FILE`: its source, file and
        fields as JSON), where the transform keeps rows as they are; read only by :meth:`late`, which Spark's
        column pruning leaves out of every other plan."""
        if self._windowed is None:
            self._windowed = self._with_windows(self.events(), carry=not self.bounded)
        return self._windowed

    def _with_windows(self, events: DataFrame, carry: bool = False) -> DataFrame:
        job = self.job
        if carry:
            original = once("original event", lambda: F.struct(
                F.col("source").alias("s"), F.col("source_file").alias("f"),
                F.to_json(F.struct(*[F.col(f) for f in dict.fromkeys(n for s in job.sources for n in s.field_names)]))
                .alias("e")), job)
            measured = transformed_carrying(events, original, job.transform)
        else:
            measured = job.transform(events)
        once("transform output checked", lambda: _check_transform_output(job, measured.columns), job)
        one = once("one window", lambda: job.window.one_window(F.unix_millis(F.col(job.source.event_time))), job)
        if one is None:
            windowed = job.window.assign(measured, F.unix_millis(F.col(job.source.event_time)))
            return windowed.withColumn("_late", self._late_condition())
        ws, we = one  # one window per event: one projection, its expressions built once per job
        return measured.select(F.col("*"), ws.alias(WS), we.alias(WE), self._late_condition(we).alias("_late"))

    def late_horizon_ms(self) -> int:
        """A (row, window) is late when ``end + L <= W_in``; every window of an event ends after it, so only
        events before ``W_in - L`` can be late."""
        return self.watermark_in_ms - self.job.watermark.allowed_lateness_ms

    def late(self) -> DataFrame:
        """Late side output: the event, the window it missed, the watermark and by how much. The (event, window)
        rows of :meth:`windowed` flagged late, with the originals they carried: one job, whose filter Spark
        evaluates before the transform's projections, so those cost what the late events bring. A transform
        that carries nothing through (an aggregate, SQL over a view): built from the events that can be late
        alone (before :meth:`late_horizon_ms`: in a stream, a handful per batch), joined with their originals."""
        job, key = self.job, self.job.source.dedup_key
        t_ms = F.unix_millis(F.col(job.source.event_time))
        windowed = self.windowed()
        if FILE in windowed.columns:
            original = F.col(FILE)
            return windowed.where(F.col("_late")).select(
                *job.keys, F.col(key), F.col(job.source.event_time),
                F.timestamp_millis(F.col(WS)).alias("window_start"), F.timestamp_millis(F.col(WE)).alias("window_end"),
                F.lit(self.watermark_in_ms).cast("long").alias("watermark_ms"),
                (F.lit(self.watermark_in_ms) - t_ms).cast("long").alias("late_by_ms"),
                original["s"].alias("source"), original["f"].alias("source_file"), original["e"].alias("event"),
            )
        fields = [f for f in dict.fromkeys(n for s in job.sources for n in s.field_names)]
        candidates = self.events().where(as_param(F.col("event_time_ms")) < param(self.late_horizon_ms()))
        originals = candidates.select(
            F.col(key).alias("_id"), F.col("source").alias("_src"), F.col("source_file").alias("_file"),
            F.to_json(F.struct(*[F.col(f) for f in fields])).alias("_event"),
        )
        missed = self._with_windows(candidates).where(F.col("_late")).select(*job.keys, key, job.source.event_time, WS, WE)
        joined = missed.join(F.broadcast(originals), missed[key] == originals["_id"], "left")
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
        if self.bounded or min_t is None or not self._late_candidates:
            return False
        return self.job.window.may_be_late(min_t, self.job.watermark.allowed_lateness_ms, self.watermark_in_ms)

    def types(self) -> dict[str, T.DataType]:
        """The aggregates' types (fixed by the job's declaration: worked out once per job and process)."""
        key = (self.job.name, self.job.fingerprint(), self.job.transform, tuple(self.job.sources))
        if key not in _TYPES:
            schema = self.windowed().schema
            _TYPES[key] = types_of(self.job, schema)
        return _TYPES[key]

    def pieces(self) -> DataFrame:
        """This batch's partial aggregates of on-time events: per window (sessions: per merged interval)."""
        job = self.job
        types = self.types()
        aggregates = Aggregates(job, types)
        on_time, columns = once("piece columns", lambda: (
            ~F.col("_late"), [F.col(c) for c in (*job.keys, WS, WE)] + aggregates.event_columns()), job)
        return aggregates.merge(select(self.windowed().where(on_time), columns))

    # -- firing ----------------------------------------------------------------------------
    def fire(self, watermark_out_ms: int) -> Fired:
        """The main-table rows of the windows due at ``W_out``, and what the store must remember."""
        job = self.job
        aggregates = Aggregates(job, self.types())
        pieces = self.pieces()
        if self.bounded:
            merged = aggregates.finalized(aggregates.merge(pieces))
            return Fired(rows=aggregates.sink_rows(merged.where(aggregates.passing())))
        fired = job.window.fire(Firing(
            keys=job.keys, lateness_ms=job.watermark.allowed_lateness_ms, watermark_in_ms=self.watermark_in_ms,
            watermark_out_ms=watermark_out_ms, batch_id=self.batch_id, pieces=pieces, store=self.store,
            aggregates=aggregates, upserts=job.upserts, having=bool(job.having), cache=self.cache))
        fired.store["ids"] = self.new_ids()
        return fired

    def release(self) -> None:
        if self._counting is not None:
            self._counting.exception()  # (let it end before its cache goes)
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
    size = estimated_bytes(raw)
    to_driver = size is not None and size <= DRIVER_LOOKUP_BYTES
    large = False
    if not bounded:
        if lines_before is not None and lines_before > INTERPRETED_BATCH_LINES:
            large = True
        else:  # the first batch of a stream, or one after a small batch: by the size of its input files
            large = size is not None and size > LARGE_BATCH_BYTES
    return WindowedBatch(job=job, watermark_in_ms=watermark_in_ms, bounded=bounded, parsed=parsed, store=store,
                         event_range_ms=event_range_ms, batch_id=batch_id, expect_large=large, ids_to_driver=to_driver)


# A batch whose input Spark estimates at more than this many bytes is expected to be large: its statistics job also
# finds its repeated ids (one job less). A payment line is ~190 bytes, estimated at ~330 with the columns the
# source adds: ~25k lines and more.
LARGE_BATCH_BYTES = 8_000_000
