"""A windowed job's aggregates: their fixed types, how partial values (pieces) combine into a window's value
(through the window kind's ``merge``), the ``having`` verdict, and the main table's rows."""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from ..declaration import WindowedJob
from ..io.sinks.base import OP
from ..spark.columns import once, select
from ..windows import WE, WS


def _agg_expr(kind: str, column: str) -> Column:
    if kind == "count":
        return F.count(F.lit(1)) if column == "*" else F.sum(column)
    return {"sum": F.sum, "min": F.min, "max": F.max}[kind](column)


class Aggregates:
    """How a job's pieces combine into windows, which windows pass ``having``, and their sink rows."""

    def __init__(self, job: WindowedJob, types: dict[str, T.DataType]):
        self.job = job
        self.types = types
        self.aggs = [a.name for a in job.aggregates]

    def combine(self) -> list[Column]:
        return once("combine", lambda: [
            _agg_expr("sum" if a.kind == "count" else a.kind, a.name).cast(self.types[a.name]).alias(a.name)
            for a in self.job.aggregates], self.job)

    def merge(self, pieces: DataFrame, extra: list[Column] = ()) -> DataFrame:
        """One row per window (as the job's window kind merges pieces) with its value."""
        return self.job.window.merge(pieces, self.job.keys, self.combine(), extra)

    def passing(self) -> Column:
        return F.coalesce(F.expr(self.job.having), F.lit(False)) if self.job.having else F.lit(True)

    def sink_rows(self, windows: DataFrame) -> DataFrame:
        """The main table's columns of merged windows."""
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
