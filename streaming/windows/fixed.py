"""Windows on a fixed grid of event time: ``[k*every, k*every + size)``. Tumbling windows (``every = size``)
and sliding windows share everything but the grid; each window is known by its keys and start."""

from __future__ import annotations

from typing import Sequence

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from ..spark.columns import as_param, group, join_keys, once, param
from .base import WE, WS, Fired, Firing, Window


class FixedWindows(Window):
    """The logic of grid windows; a kind gives ``size_ms`` and ``every_ms``."""

    size_ms: int
    every_ms: int

    @property
    def windows_per_event(self) -> int:
        return -(-self.size_ms // self.every_ms)

    # -- assignment -----------------------------------------------------------------------------
    def assign(self, frame: DataFrame, time_ms: Column) -> DataFrame:
        size, every = self.size_ms, self.every_ms
        last = time_ms - F.pmod(time_ms, F.lit(every))  # the latest window start at or before the event
        if self.windows_per_event > 1:
            frame = frame.withColumn("_back", F.explode(F.sequence(F.lit(0), F.lit(self.windows_per_event - 1))))
            frame = frame.withColumn(WS, last - F.col("_back") * F.lit(every)).drop("_back")
            frame = frame.where(F.col(WS) + F.lit(size) > time_ms)
        else:
            frame = frame.withColumn(WS, last)
        return frame.withColumn(WE, F.col(WS) + F.lit(size))

    def one_window(self, time_ms: Column) -> tuple[Column, Column] | None:
        if self.windows_per_event > 1:
            return None
        start = time_ms - F.pmod(time_ms, F.lit(self.every_ms))
        return start, start + F.lit(self.size_ms)

    # -- combining --------------------------------------------------------------------------------
    def merge(self, pieces: DataFrame, keys: Sequence[str], combine: list[Column],
              extra: Sequence[Column] = ()) -> DataFrame:
        groups = once(("window groups", tuple(keys)), lambda: [F.col(c) for c in (*keys, WS, WE)], self)
        if not extra:
            return group(pieces, groups, combine)
        return pieces.groupBy(*groups).agg(*combine, *extra)

    # -- firing ---------------------------------------------------------------------------------
    def fire(self, f: Firing) -> Fired:
        """A window is due the first time ``end <= W_out`` (``end`` in ``(W_in, W_out]``), and when this batch
        corrects it (``end <= W_in``, within lateness). A fired window is in the sink iff its value before
        this batch satisfied ``having``."""
        w_in, w_out, size, every = f.watermark_in_ms, f.watermark_out_ms, self.size_ms, self.every_ms
        lo, hi = w_in - f.lateness_ms - size + 1, w_out - size  # the starts of every window that may be due
        if lo + (-lo) % every > hi:  # no window starts there (starts are multiples of the slide): none due
            return Fired(store={"pieces": f.pieces})
        pieces = f.cache(f.pieces)  # read by the store's write and by the firing, concurrently
        windows = f.aggregates
        in_range = (as_param(F.col(WS)) >= param(lo)) & (as_param(F.col(WS)) <= param(hi))
        now = pieces.where(in_range).withColumn("_now", F.lit(True))
        earlier = f.store.in_range("pieces", lo, hi) if f.store is not None else None
        both = now if earlier is None else earlier.withColumn("_now", F.lit(False)).unionByName(now)
        passing = windows.passing()
        merged = windows.finalized(windows.merge(both, [F.max("_now").alias("_now")]))
        first = as_param(F.col(WE)) > param(w_in)
        store = {"pieces": pieces}
        if not f.upserts:
            return Fired(rows=windows.sink_rows(merged.where(first & passing)), store=store)
        corrected = ~first & F.col("_now")
        due = merged.where(first | corrected)
        written = windows.upserts(due.where(passing))
        if earlier is None or not f.having:
            return Fired(rows=written, store=store)
        before = windows.finalized(windows.merge(earlier)).where(passing).select(*f.keys, WS).withColumn("_was", F.lit(True))
        left = join_keys(due.where(corrected & ~passing), before, [*f.keys, WS], "inner")
        return Fired(rows=written.unionByName(windows.deletes(left)), store=store)

    # -- lateness -------------------------------------------------------------------------------
    def may_be_late(self, earliest_event_ms: int, lateness_ms: int, watermark_ms: int) -> bool:
        # An event's windows all end after it, so ``t + L < W`` is needed for any of them to be late.
        return earliest_event_ms + lateness_ms < watermark_ms

    def late_windows(self, windows: DataFrame, late: DataFrame, keys: Sequence[str], event_time: str) -> DataFrame:
        return late.select(*keys, "window_start").distinct()

    # -- bounded runs ---------------------------------------------------------------------------
    def events_for(self, lo_ms: int, hi_ms: int) -> tuple[int, int] | None:
        """Windows starting in ``[lo, hi)`` start on the grid from the first multiple of ``every`` at or after
        ``lo`` to the last one before ``hi``, and the last of them ends ``size`` after its start, after ``hi``
        whenever the range ends inside a window."""
        first = -(-lo_ms // self.every_ms) * self.every_ms
        last = (hi_ms - 1) // self.every_ms * self.every_ms
        return first, last + self.size_ms

    def final_horizon_ms(self, watermark_ms: int, lateness_ms: int, open_starts_ms: Sequence[int]) -> int:
        """A window is final when ``end + L <= W``, i.e. when it starts at or before ``W - L - size``; the
        horizon is the first start on the grid after that, so every window starting before it is final."""
        last_final = (watermark_ms - lateness_ms - self.size_ms) // self.every_ms * self.every_ms
        return last_final + self.every_ms
