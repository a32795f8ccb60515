"""The columns of a job's tables and of the raw input, as Spark types: what the main table, the late side
output and the quarantine tables hold, and which column places a row in time."""

from __future__ import annotations

from pyspark.sql import types as T

from ..declaration import Agg, Job, KeyedJob, WindowedJob

RAW_SCHEMA = T.StructType([
    T.StructField("value", T.StringType()),
    T.StructField("source_file", T.StringType()),
    T.StructField("_source", T.StringType()),
])
QUARANTINE_SCHEMA = T.StructType([
    T.StructField("source", T.StringType()),
    T.StructField("source_file", T.StringType()),
    T.StructField("raw_line", T.StringType()),
    T.StructField("reason", T.StringType()),
    T.StructField("occurrences", T.LongType()),
    T.StructField("detected_by", T.StringType()),
    T.StructField("written_by", T.StringType()),  # the commit that wrote the row: <query id>[:<epoch>]:<batch>, or a backfill
    T.StructField("batch_id", T.LongType()),  # the stream's batch (NULL: written by a backfill)
])


def main_time_column(job: Job) -> str:
    """The column that places a main-table row in time (partitions, backfill ranges)."""
    return job.time_column if isinstance(job, KeyedJob) else "window_start"


def late_time_column(job: Job) -> str:
    return job.source.event_time if isinstance(job, KeyedJob) else "window_start"


def late_schema(job: Job, transformed: T.StructType) -> T.StructType:
    """The late side output, one schema for every job: the event's keys, id and time, the window it
    missed (windowed jobs), the watermark and by how much, where it came from, the event as JSON."""
    return T.StructType(
        [T.StructField(k, transformed[k].dataType) for k in job.keys]
        + [T.StructField(job.source.dedup_key, transformed[job.source.dedup_key].dataType),
           T.StructField(job.source.event_time, T.TimestampType()),
           T.StructField("window_start", T.TimestampType()), T.StructField("window_end", T.TimestampType()),
           T.StructField("watermark_ms", T.LongType()), T.StructField("late_by_ms", T.LongType()),
           T.StructField("source", T.StringType()), T.StructField("source_file", T.StringType()),
           T.StructField("event", T.StringType())]
    )


def piece_name(agg: Agg) -> str:
    """The store column of an aggregate's piece (its own name where the piece is the value)."""
    return agg.name if agg.kind in ("count", "sum", "min", "max") else f"_p_{agg.name}"


def sum_type(source: T.DataType) -> T.DataType:
    if isinstance(source, T.DecimalType):
        return T.DecimalType(38, source.scale)
    if isinstance(source, (T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.BooleanType)):
        return T.LongType()
    return T.DoubleType()


def aggregate_type(agg: Agg, schema: T.StructType) -> T.DataType:
    """The fixed type of an aggregate's value in the sink (pieces and sink keep one schema across batches)."""
    if agg.kind in ("count", "count_distinct", "approx_count_distinct"):
        return T.LongType()
    source = schema[agg.column].dataType
    if agg.kind in ("min", "max", "first", "last"):
        return source
    if agg.kind == "sum":
        return sum_type(source)
    if agg.kind == "avg" and isinstance(source, T.DecimalType):
        return T.DecimalType(min(38, source.precision + 4), min(38, source.scale + 4))
    return T.DoubleType()  # avg of other numbers, percentile


def piece_type(agg: Agg, schema: T.StructType) -> T.DataType:
    """The fixed type of an aggregate's piece in the store."""
    kind = agg.kind
    if kind in ("count", "sum", "min", "max"):
        return aggregate_type(agg, schema)
    source = schema[agg.column].dataType
    if kind == "avg":
        return T.StructType([T.StructField("s", sum_type(source)), T.StructField("n", T.LongType())])
    if kind == "count_distinct":
        return T.ArrayType(source)
    if kind == "approx_count_distinct":
        return T.MapType(T.IntegerType(), T.IntegerType())
    if kind in ("first", "last"):
        return T.StructType([T.StructField("t", T.LongType()), T.StructField("id", T.StringType()),
                             T.StructField("v", source)])
    return T.MapType(T.LongType(), T.LongType())  # percentile


def types_of(job: WindowedJob, schema: T.StructType) -> dict[str, T.DataType]:
    """Every aggregate's value type (by its name) and piece type (by :func:`piece_name`)."""
    types: dict[str, T.DataType] = {}
    for agg in job.aggregates:
        types[agg.name] = aggregate_type(agg, schema)
        types[piece_name(agg)] = piece_type(agg, schema)
    return types


def windowed_fields(job: Job, transformed: T.StructType) -> tuple[list[T.StructField], list[T.StructField]]:
    """(key fields, aggregate fields) of a windowed job."""
    keys = [T.StructField(k, transformed[k].dataType) for k in job.keys]
    return keys, [T.StructField(a.name, aggregate_type(a, transformed)) for a in job.aggregates]


def piece_fields(job: Job, transformed: T.StructType) -> list[T.StructField]:
    """The store's piece columns of a windowed job's aggregates."""
    return [T.StructField(piece_name(a), piece_type(a, transformed)) for a in job.aggregates]
