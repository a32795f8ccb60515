"""A windowed job's aggregates: their fixed types, how partial values (pieces) combine into a window's value
(through the window kind's ``merge``), the ``having`` verdict, and the main table's rows.

Every aggregate is mergeable: an event becomes a *piece value*, pieces combine (within a batch, across
batches in the store, in the bounded twin), and a window's combined piece gives its value. For ``count``,
``sum``, ``min`` and ``max`` the piece value is the value itself and is stored under the aggregate's name
(as every checkpoint has it); the others keep a piece of their own, stored as ``_p_<name>``:

=========================  ====================================  =========================================
aggregate                  piece (per window, per batch)         value
=========================  ====================================  =========================================
``avg``                    struct(sum, count)                    sum / count
``count_distinct``         the distinct values (an array)        their number (exact)
``approx_count_distinct``  HyperLogLog registers: a map of at    its estimate: relative standard error
                           most 4,096 (register -> rank)         1.04 / sqrt(4096) = 1.6 %
``first`` / ``last``       struct(event time, dedup key, value)  the value of the min / max struct
``percentile``             log-bucketed counts: a map (bucket    the representative of the bucket that holds
                           of ratio 1.0202 -> count)             rank ceil(q * n): within 1 % (relative)
=========================  ====================================  =========================================

Sketches combine by a maximum or a sum per register or bucket, so the stream (however its batches split a
window's events) and the bounded twin reach the same value for the same events: reconciliation compares
them exactly.
"""

from __future__ import annotations

import math

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from ..declaration import Agg, WindowedJob
from ..io.schemas import piece_name, types_of  # noqa: F401 - (types_of: the types an Aggregates takes)
from ..io.sinks.base import OP
from ..spark.columns import once, select
from ..windows import WE, WS

HLL_P = 12  # HyperLogLog precision: 2^12 registers
_HLL_M = 1 << HLL_P
PERCENTILE_ALPHA = 0.01  # relative accuracy of ``percentile``
_GAMMA = (1 + PERCENTILE_ALPHA) / (1 - PERCENTILE_ALPHA)
_BUCKET_OFFSET = 1 << 20  # positive values' buckets are > 0, negative ones < 0, zero is bucket 0


# -- the kinds ---------------------------------------------------------------------------------------

def _let(value: Column, body) -> Column:
    """``body(value)`` with ``value`` computed once (an expression named inside a lambda is computed again at
    each of the lambda's calls; a lambda's argument is not)."""
    return F.element_at(F.transform(F.array(value), body), 1)


def _merge_maps(column: Column, combine: str, map_type: T.MapType) -> Column:
    """A map with every key of the maps in ``column``'s group, their values combined (``max`` or ``sum``).

    In O(n log n) of the group's entries: they are sorted by key, each run of one key is found by its
    first index, and a run's values are summed (or its last, the largest, is taken). (Folding map into
    map rebuilds the accumulator per piece: 80 s for 50,000 events of one window.)"""
    empty = F.create_map().cast(map_type)

    def runs(entries: Column) -> Column:
        n = F.size(entries)
        starts = F.filter(F.sequence(F.lit(1), n), lambda i: (i == 1) | (
            F.element_at(entries, i)["key"] != F.element_at(entries, i - 1)["key"]))
        return F.when(n > 0, _let(starts, lambda s: merged(entries, n, s))).otherwise(empty)

    def merged(entries: Column, n: Column, starts: Column) -> Column:
        ends = F.transform(starts, lambda s, j: F.coalesce(F.try_element_at(starts, j + 2), n + 1) - 1)
        keys = F.transform(starts, lambda s: F.element_at(entries, s)["key"])
        if combine == "max":  # (sorted by key, then value: a run's last entry holds its largest value)
            values = F.transform(ends, lambda e: F.element_at(entries, e)["value"])
        else:
            values = F.zip_with(starts, ends, lambda s, e: F.aggregate(
                F.slice(entries, s, e - s + 1), F.lit(0).cast(map_type.valueType), lambda acc, x: acc + x["value"]))
        return F.map_from_arrays(keys, values).cast(map_type)

    return _let(F.array_sort(F.flatten(F.collect_list(F.map_entries(column)))), runs)


def _event_value(agg: Agg, job: WindowedJob, types: dict[str, T.DataType]) -> Column:
    """One event's piece value for ``agg``."""
    kind, ptype = agg.kind, types[piece_name(agg)]
    if kind == "count" and agg.column == "*":
        return F.lit(1).cast(ptype)
    x = F.col(agg.column)
    if kind in ("count", "sum", "min", "max"):
        return x.cast(ptype)
    present = x.isNotNull()
    if kind == "avg":
        return F.when(present, F.struct(x.cast(ptype["s"].dataType).alias("s"), F.lit(1).cast("long").alias("n")))
    if kind == "count_distinct":
        return F.when(present, F.array(x)).otherwise(F.array().cast(ptype))
    if kind == "approx_count_distinct":
        h = F.xxhash64(x.cast("string"))
        register = h.bitwiseAND(F.lit(_HLL_M - 1)).cast("int")
        w = F.shiftrightunsigned(h, HLL_P)  # the remaining 52 bits: their leading zeros + 1 is the rank
        rank = F.when(w == 0, F.lit(64 - HLL_P + 1)).otherwise(F.lit(64 - HLL_P + 1) - F.length(F.bin(w)))
        return F.when(present, F.create_map(register, rank.cast("int")))
    if kind in ("first", "last"):
        t = F.unix_millis(F.col(job.source.event_time))
        return F.when(present, F.struct(t.alias("t"), F.col(job.source.dedup_key).cast("string").alias("id"),
                                        x.alias("v")))
    # percentile: the value's bucket, counted once
    v = x.cast("double")
    log_gamma = math.log(_GAMMA)
    up = lambda a: F.ceil(F.log(a) / F.lit(log_gamma)).cast("long")  # noqa: E731
    bucket = (F.when(v > 0, F.lit(_BUCKET_OFFSET) + up(v)).when(v < 0, -(F.lit(_BUCKET_OFFSET) + up(-v)))
              .when(v == 0, F.lit(0)))
    return F.when(bucket.isNotNull(), F.create_map(bucket.cast("long"), F.lit(1).cast("long")))


def _combine(agg: Agg, column: Column, ptype: T.DataType) -> Column:
    """Pieces' combination (an aggregate over a group of pieces)."""
    kind = agg.kind
    if kind in ("count", "sum"):
        return F.sum(column)
    if kind in ("min", "first"):
        return F.min(column)
    if kind in ("max", "last"):
        return F.max(column)
    if kind == "avg":
        return F.struct(F.sum(column["s"]).alias("s"), F.sum(column["n"]).alias("n"))
    if kind == "count_distinct":
        return F.array_distinct(F.flatten(F.collect_list(column)))
    return _merge_maps(column, "max" if kind == "approx_count_distinct" else "sum", ptype)


def _value(agg: Agg, piece: Column, vtype: T.DataType) -> Column:
    """A window's value from its combined piece."""
    kind = agg.kind
    if kind in ("count", "sum", "min", "max"):
        return piece
    if kind == "avg":
        return (piece["s"] / piece["n"]).cast(vtype)
    if kind == "count_distinct":
        return F.coalesce(F.size(piece), F.lit(0)).cast("long")
    if kind in ("first", "last"):
        return piece["v"]
    if kind == "approx_count_distinct":
        m = float(_HLL_M)
        present = F.coalesce(F.size(piece), F.lit(0))
        empty = F.lit(m) - present
        z = F.aggregate(F.map_values(F.coalesce(piece, F.create_map().cast("map<int,int>"))), F.lit(0.0),
                        lambda acc, r: acc + F.pow(F.lit(2.0), -r.cast("double"))) + empty
        alpha = 0.7213 / (1 + 1.079 / m)
        raw = F.lit(alpha * m * m) / z
        estimate = F.when((raw <= F.lit(2.5 * m)) & (empty > 0), F.lit(m) * F.log(F.lit(m) / empty)).otherwise(raw)
        return F.round(estimate).cast("long")
    # percentile: walk the buckets in order until rank ceil(q * n)
    counts = F.coalesce(piece, F.create_map().cast("map<bigint,bigint>"))
    n = F.aggregate(F.map_values(counts), F.lit(0).cast("long"), lambda acc, c: acc + c)
    target = F.greatest(F.lit(1), F.ceil(n.cast("double") * F.lit(float(agg.q)) - F.lit(1e-9)))
    start = F.struct(F.lit(0).cast("long").alias("n"), F.lit(None).cast("long").alias("k"))
    walked = F.aggregate(F.array_sort(F.map_entries(counts)), start, lambda acc, e: F.when(
        acc["n"] >= target, acc).otherwise(F.struct((acc["n"] + e["value"]).alias("n"), e["key"].alias("k"))))
    k = walked["k"]
    representative = lambda i: F.lit(2.0) * F.pow(F.lit(_GAMMA), i.cast("double")) / F.lit(_GAMMA + 1)  # noqa: E731
    return (F.when(n == 0, F.lit(None).cast("double"))
            .when(k > 0, representative(k - F.lit(_BUCKET_OFFSET)))
            .when(k < 0, -representative(-k - F.lit(_BUCKET_OFFSET)))
            .otherwise(F.lit(0.0)))


class Aggregates:
    """How a job's pieces combine into windows, which windows pass ``having``, and their sink rows.

    ``types``: :func:`types_of` (value types by aggregate name, piece types by :func:`piece_name`)."""

    def __init__(self, job: WindowedJob, types: dict[str, T.DataType]):
        self.job = job
        self.types = types
        self.aggs = [a.name for a in job.aggregates]
        self.pieces = [piece_name(a) for a in job.aggregates]
        self._derived = [a for a in job.aggregates if piece_name(a) != a.name]

    def event_columns(self) -> list[Column]:
        """One event's piece values (one column per piece)."""
        return once("event pieces", lambda: [_event_value(a, self.job, self.types).alias(piece_name(a))
                                             for a in self.job.aggregates], self.job)

    def combine(self) -> list[Column]:
        return once("combine", lambda: [
            _combine(a, F.col(piece_name(a)), self.types[piece_name(a)]).cast(self.types[piece_name(a)])
            .alias(piece_name(a)) for a in self.job.aggregates], self.job)

    def merge(self, pieces: DataFrame, extra: list[Column] = ()) -> DataFrame:
        """One row per window (as the job's window kind merges pieces) with its combined pieces."""
        return self.job.window.merge(pieces, self.job.keys, self.combine(), extra)

    def finalized(self, windows: DataFrame) -> DataFrame:
        """Merged windows with each aggregate's value under its name (beside the pieces it comes from)."""
        if not self._derived:
            return windows
        values = once("values", lambda: [_value(a, F.col(piece_name(a)), self.types[a.name]).alias(a.name)
                                         for a in self._derived], self.job)
        return windows.select(F.col("*"), *values)

    def passing(self) -> Column:
        """``having`` over a :meth:`finalized` frame."""
        return F.coalesce(F.expr(self.job.having), F.lit(False)) if self.job.having else F.lit(True)

    def sink_rows(self, windows: DataFrame) -> DataFrame:
        """The main table's columns of :meth:`finalized` windows."""
        return select(windows, once("sink columns", lambda: [
            *[F.col(c) for c in self.job.keys], F.timestamp_millis(F.col(WS)).alias("window_start"),
            F.timestamp_millis(F.col(WE)).alias("window_end"), *[F.col(a) for a in self.aggs]], self.job))

    def upserts(self, windows: DataFrame) -> DataFrame:
        """Sink rows of merged windows to write over what the table holds for them (``_op = upsert``)."""
        return self.sink_rows(windows).withColumn(OP, F.lit("upsert"))

    def deletes(self, keys_and_starts: DataFrame) -> DataFrame:
        """Delete rows (``_op = delete``) for (keys, ``ws``) of sink rows to retract."""
        return keys_and_starts.select(
            *self.job.keys, F.timestamp_millis(F.col(WS)).alias("window_start"),
            F.lit(None).cast("timestamp").alias("window_end"),
            *[F.lit(None).cast(self.types[a]).alias(a) for a in self.aggs], F.lit("delete").alias(OP),
        )
