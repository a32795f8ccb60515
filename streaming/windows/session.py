"""Session windows: per key, events closer than ``gap`` form one session, ``[first event, last event + gap)``.

Each event opens the window ``[t, t + gap)``; windows of one key that overlap *or touch* merge (Flink's
rule: two events exactly ``gap`` apart stay in one session, 1 ms more starts a new one). A stream keeps
each session's last evaluation (``evals`` in the store: its extent, value and ``having`` verdict), so a
merge retracts exactly the rows of the sessions it absorbed that are in the sink.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

from pyspark.sql import Column, DataFrame
from pyspark.sql import Window as SparkWindow
from pyspark.sql import functions as F

from ..spark.columns import as_param, join_keys, param, same_keys
from ..time import format_duration, positive, to_ms
from .base import WE, WS, Fired, Firing, Window


@dataclass(frozen=True)
class Session(Window):
    """Per-key sessions of activity separated by at least ``gap`` of event time."""

    gap: timedelta

    def __post_init__(self) -> None:
        positive("Session.gap", self.gap)

    @property
    def gap_ms(self) -> int:
        return to_ms(self.gap)

    def describe(self) -> str:
        return f"Session(gap={format_duration(self.gap)})"

    # -- assignment -----------------------------------------------------------------------------
    def assign(self, frame: DataFrame, time_ms: Column) -> DataFrame:
        return frame.withColumn(WS, time_ms).withColumn(WE, time_ms + F.lit(self.gap_ms))

    # -- combining --------------------------------------------------------------------------------
    def merge(self, pieces: DataFrame, keys: Sequence[str], combine: list[Column],
              extra: Sequence[Column] = ()) -> DataFrame:
        # Gaps and islands: a piece starts a new session when it starts after every earlier end of its key.
        order = SparkWindow.partitionBy(*keys).orderBy(WS, WE)
        before = F.max(WE).over(order.rowsBetween(SparkWindow.unboundedPreceding, -1))
        pieces = pieces.withColumn("_new", F.when(before.isNull() | (F.col(WS) > before), 1).otherwise(0))
        pieces = pieces.withColumn("_sid", F.sum("_new").over(order.rowsBetween(SparkWindow.unboundedPreceding, 0)))
        return pieces.groupBy(*keys, "_sid").agg(F.min(WS).alias(WS), F.max(WE).alias(WE), *combine,
                                                 *extra).drop("_sid")

    # -- firing ---------------------------------------------------------------------------------
    def fire(self, f: Firing) -> Fired:
        """The keys with pieces in this batch or with a session that may close now are re-merged from all
        their pieces; a session is due when ``end <= W_out`` and it differs from its last evaluation
        (``evals``). Rows of the sessions it absorbed that are in the sink are deleted; the evaluation is
        remembered, the absorbed ones are marked gone."""
        w_in, w_out, lateness = f.watermark_in_ms, f.watermark_out_ms, f.lateness_ms
        windows, keys = f.aggregates, list(f.keys)
        aggs = windows.aggs
        pieces = f.cache(f.pieces)  # read by the store's write and by the firing
        store = {"pieces": pieces}
        earlier = f.store.every("pieces") if f.store is not None else None
        candidates = pieces.select(*keys)
        if earlier is not None:
            closing = earlier.where((as_param(F.col(WE)) > param(w_in)) & (as_param(F.col(WE)) <= param(w_out)))
            candidates = candidates.unionByName(closing.select(*keys))
            # their sessions before this batch, as pieces; those closed for good (end + L <= W_in) are gone
            before = windows.merge(join_keys(earlier, candidates.distinct(), keys, "left_semi"))
            pieces = before.where(as_param(F.col(WE) + F.lit(lateness)) > param(w_in)).unionByName(pieces)
        sessions = windows.finalized(windows.merge(pieces)).where(as_param(F.col(WE)) <= param(w_out))
        evals = latest_evals(f.store, keys)
        if evals is None:
            judged = sessions.select("*", F.lit(False).alias("_unchanged"), F.array().cast("array<bigint>").alias("_in_sink"),
                                     F.array().cast("array<bigint>").alias("_absorbed"))
        else:
            e = evals.select(*[F.col(k).alias(f"_e_{k}") for k in keys], F.col(WS).alias("_e_ws"),
                             F.col(WE).alias("_e_we"), *[F.col(a).alias(f"_e_{a}") for a in aggs],
                             F.col("passing").alias("_e_passing"))
            inside = same_keys(keys, "_e_") & (F.col("_e_ws") >= F.col(WS)) & (F.col("_e_ws") < F.col(WE))
            same = (F.col("_e_ws") == F.col(WS)) & (F.col("_e_we") == F.col(WE))
            for a in aggs:
                same = same & F.col(f"_e_{a}").eqNullSafe(F.col(a))
            judged = sessions.join(e, inside, "left").groupBy(*keys, WS, WE).agg(
                *[F.first(a).alias(a) for a in aggs],
                F.max(F.coalesce(same, F.lit(False))).alias("_unchanged"),
                F.collect_list(F.when(F.col("_e_passing"), F.col("_e_ws"))).alias("_in_sink"),
                F.collect_list(F.when(F.col("_e_ws") != F.col(WS), F.col("_e_ws"))).alias("_absorbed"),
            )
        due = f.cache(judged.where(~F.col("_unchanged")).withColumn("_passing", windows.passing()))
        if f.upserts:
            retract = due.select(*keys, F.explode(F.filter("_in_sink", lambda s: (s != F.col(WS)) | ~F.col("_passing")))
                                 .alias(WS))
            rows = windows.upserts(due.where(F.col("_passing"))).unionByName(windows.deletes(retract))
        else:
            rows = windows.sink_rows(due.where(F.col("_passing")))
        batch = F.lit(f.batch_id).cast("long").alias("_batch")
        evaluated = due.select(*keys, WS, WE, *aggs, F.col("_passing").alias("passing"), F.lit(False).alias("_gone"), batch)
        gone = due.select(*keys, F.explode("_absorbed").alias(WS)).select(
            *keys, WS, F.lit(None).cast("long").alias(WE), *[F.lit(None).cast(windows.types[a]).alias(a) for a in aggs],
            F.lit(None).cast("boolean").alias("passing"), F.lit(True).alias("_gone"), batch)
        store["evals"] = evaluated.unionByName(gone)
        return Fired(rows=rows, store=store)

    # -- lateness -------------------------------------------------------------------------------
    def may_be_late(self, earliest_event_ms: int, lateness_ms: int, watermark_ms: int) -> bool:
        # An event's own window [t, t + gap) is late when t + gap + L <= W (the late rule of every window).
        return earliest_event_ms + self.gap_ms + lateness_ms <= watermark_ms

    def late_windows(self, windows: DataFrame, late: DataFrame, keys: Sequence[str], event_time: str) -> DataFrame:
        """A late event within a gap of a session would have joined it."""
        gap = F.expr(f"INTERVAL {self.gap_ms} MILLISECONDS")
        events = late.select(*[F.col(k).alias(f"_l_{k}") for k in keys], F.col(event_time).alias("_lt"))
        near = same_keys(keys, "_l_") & (F.col("_lt") >= F.col("window_start") - gap) & (F.col("_lt") <= F.col("window_end"))
        return windows.join(events, near, "left_semi").select(*keys, "window_start").distinct()

    # -- bounded runs ---------------------------------------------------------------------------
    def events_for(self, lo_ms: int, hi_ms: int) -> tuple[int, int] | None:
        """None: a session starting in the range may chain events of any time after it (and the sessions
        before it decide where it starts), so a bounded run reads every event."""
        return None

    def final_horizon_ms(self, watermark_ms: int, lateness_ms: int, open_starts_ms: Sequence[int]) -> int:
        # a session still open may start as early as its first piece
        return min([watermark_ms - lateness_ms - self.gap_ms, *open_starts_ms])

    def pieces_expire(self) -> bool:
        return False


def latest_evals(store, keys: Sequence[str]) -> DataFrame | None:
    """The newest evaluation of each session start still remembered (gone ones dropped)."""
    if store is None:
        return None
    evals = store.every("evals")
    if evals is None:
        return None
    return newest_evals(evals, keys)


def newest_evals(evals: DataFrame, keys: Sequence[str]) -> DataFrame:
    newest = SparkWindow.partitionBy(*keys, WS).orderBy(F.col("_batch").desc())
    return evals.withColumn("_r", F.row_number().over(newest)).where((F.col("_r") == 1) & ~F.col("_gone")).drop("_r")
