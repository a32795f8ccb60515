"""A job's tables (main sink, late side output, quarantine), their schemas and their creation.

Schemas are derived from the job's own plan over an empty input, so the tables always match what
the engine writes.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark.sql import types as T

from . import sinks
from .declaration import IcebergTable, WindowedJob
from .engine import plan_batch

RAW_SCHEMA = T.StructType([T.StructField("value", T.StringType()), T.StructField("source_file", T.StringType())])


@dataclass(frozen=True)
class JobTables:
    main: T.StructType
    late: T.StructType
    quarantine: T.StructType


def schemas(spark, job: WindowedJob) -> JobTables:
    plan = plan_batch(job, spark.createDataFrame([], RAW_SCHEMA))
    return JobTables(
        main=plan.finish(0).emitted.schema,
        late=plan.late().schema,
        quarantine=plan.quarantine().schema,
    )


def ensure_job_tables(spark, job: WindowedJob) -> JobTables:
    shapes = schemas(spark, job)
    sinks.ensure_table(spark, job.sink, shapes.main, "days(window_start)", job.description)
    sinks.ensure_table(
        spark, job.late_sink, shapes.late, "days(window_start)", f"Late side output of {job.name}: events that missed their window"
    )
    sinks.ensure_table(
        spark, job.quarantine, shapes.quarantine, None, f"Invalid {job.source.name} lines with the reason"
    )
    return shapes


def all_tables(job: WindowedJob) -> list[IcebergTable]:
    return [job.sink, job.late_sink, job.quarantine]
