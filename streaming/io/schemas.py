"""The columns of a job's tables and of the raw input, as Spark types: what the main table, the late side
output and the quarantine tables hold, and which column places a row in time."""

from __future__ import annotations

from pyspark.sql import types as T

from ..declaration import Agg, Job, KeyedJob

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


def windowed_fields(job: Job, transformed: T.StructType) -> tuple[list[T.StructField], list[T.StructField]]:
    """(key fields, aggregate fields) of a windowed job."""
    keys = [T.StructField(k, transformed[k].dataType) for k in job.keys]
    return keys, [T.StructField(a.name, aggregate_type(a, transformed)) for a in job.aggregates]
