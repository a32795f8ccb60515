"""A job's tables (main sink, late side output, one quarantine table per source), their creation, and their
sinks in the configured format.

Schemas (``schemas``) are derived from the job's own plan over an empty input, so the tables always match
what the engine writes. Main and late tables are partitioned by day of their time column.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark.sql import types as T

from ..spark.jvm import parse_ddl
from ..declaration import Job, KeyedJob, Source, Table
from ..settings import Settings
from .schemas import QUARANTINE_SCHEMA, late_schema, main_time_column, late_time_column, piece_fields, windowed_fields
from .sinks import Sink, sink_for
from .validation import check_job, transformed_schema

@dataclass(frozen=True)
class TableSpec:
    table: Table
    role: str  # main | late | quarantine
    schema: T.StructType
    partition_column: str | None
    comment: str
    source: str | None = None


def store_schemas(spark, job: Job) -> dict[str, T.StructType]:
    """The incremental store's row schemas of a windowed job (see ``store``)."""
    transformed = transformed_schema(spark, job)
    keys, aggs = windowed_fields(job, transformed)
    window = [T.StructField("ws", T.LongType()), T.StructField("we", T.LongType())]
    pieces = T.StructType(keys + window + piece_fields(job, transformed))  # (the values' pieces)
    evals = T.StructType(keys + window + aggs + [T.StructField("passing", T.BooleanType()),  # (the values)
                                                 T.StructField("_gone", T.BooleanType()), T.StructField("_batch", T.LongType())])
    return {"pieces": pieces, "evals": evals}


def _schemas(spark, job: Job) -> tuple[T.StructType, T.StructType]:
    """(main table, late side output), declared from the job and its transform's columns."""
    check_job(spark, job)
    transformed = transformed_schema(spark, job)
    if isinstance(job, KeyedJob):
        return parse_ddl(job.output), late_schema(job, transformed)
    keys, aggs = windowed_fields(job, transformed)
    main = T.StructType(keys + [T.StructField("window_start", T.TimestampType()),
                                T.StructField("window_end", T.TimestampType())] + aggs)
    return main, late_schema(job, transformed)


def specs(spark, job: Job) -> list[TableSpec]:
    main, late = _schemas(spark, job)
    out = [
        TableSpec(job.sink, "main", main, main_time_column(job), job.description or job.name),
        TableSpec(job.late_sink, "late", late, late_time_column(job),
                  f"Late side output of {job.name}: events that arrived after the watermark had passed their window"),
    ]
    out += [TableSpec(s.quarantine, "quarantine", QUARANTINE_SCHEMA, None, f"Invalid {s.name} lines with the reason",
                      source=s.name) for s in job.sources]
    return out


@dataclass
class JobSinks:
    main: Sink
    late: Sink
    quarantine: dict[str, Sink]  # per source name
    schemas: dict[str, T.StructType] | None = None  # main, late (when the tables were ensured)

    def all(self) -> list[Sink]:
        return [self.main, self.late, *self.quarantine.values()]


def job_sinks(spark, settings: Settings, job: Job, *, create: bool = True) -> JobSinks:
    """The sinks of ``job`` in the configured format, created if missing."""
    made: dict[str, Sink] = {}
    quarantine: dict[str, Sink] = {}
    schemas = {}
    for spec in _cached_specs(spark, job) if create else []:
        sink = sink_for(spark, settings, spec.table, job.name)
        sink.ensure(spec.schema, spec.partition_column, spec.comment, upserts=spec.role == "main" and job.upserts)
        schemas[spec.role] = spec.schema
    for table, role, source in table_roles(job):
        sink = sink_for(spark, settings, table, job.name)
        if role == "quarantine":
            quarantine[source] = sink
        else:
            made[role] = sink
    return JobSinks(main=made["main"], late=made["late"], quarantine=quarantine, schemas=schemas or None)


class TablesPending:
    """A job's tables being created, or checked, on a thread of their own (:func:`job_sinks` with ``create``), while
    its caller goes on: a fresh home's four tables took ~1.4 s of a cold process (the catalog's first load, the
    schemas derived from the job's transform, each table's creation), and a stream's or a backfill's first Spark job
    does not need them, only its first commit does. The declaration is checked first, on the caller's thread: a job
    Spark cannot run is refused before anything starts. :meth:`wait` returns the sinks once the tables exist, or
    raises what their creation raised."""

    def __init__(self, spark, settings: Settings, job: Job):
        from concurrent.futures import ThreadPoolExecutor

        check_job(spark, job)  # (a declaration Spark cannot run is refused here, before anything starts or is created)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tables-{job.name}")
        self._future = pool.submit(job_sinks, spark, settings, job)
        pool.shutdown(wait=False)

    def wait(self) -> JobSinks:
        return self._future.result()

    def error(self, wait: bool = False) -> BaseException | None:
        """What the creation raised, once it has ended (None: it succeeded, or has not ended and ``wait`` is false)."""
        return self._future.exception() if wait or self._future.done() else None


def table_roles(job: Job) -> list[tuple[Table, str, str | None]]:
    return [(job.sink, "main", None), (job.late_sink, "late", None)] + [
        (s.quarantine, "quarantine", s.name) for s in job.sources
    ]


def _cached_specs(spark, job: Job) -> list[TableSpec]:
    key = (job, id(spark))
    if key not in _SPEC_CACHE:
        _SPEC_CACHE[key] = specs(spark, job)
    return _SPEC_CACHE[key]


_SPEC_CACHE: dict[tuple, list[TableSpec]] = {}


def all_tables(job: Job) -> list[Table]:
    return [t for t, _, _ in table_roles(job)]


def quarantine_tables(sources: tuple[Source, ...]) -> list[Table]:
    return [s.quarantine for s in sources]
