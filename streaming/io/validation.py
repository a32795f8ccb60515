"""Checks of a job declaration that need Spark's analyser (no Spark job runs): the transform works
on its sources' typed fields, keeps what the engine needs, every aggregate reads a column the
transform produces, and ``having`` is a valid predicate over the window's columns.

Called whenever a job is loaded to run (stream, backfill, reconcile, table creation), so a typo is
refused with one line naming the job, the column and the columns there are, before any stream
starts or any table is touched.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from ..declaration import Job, KeyedJob, WindowedJob
from ..errors import DeclarationError
from ..spark.jvm import parse_ddl
from .schemas import RAW_SCHEMA, aggregate_type

_CHECKED: set[tuple] = set()
_PER_SESSION: dict[tuple, tuple] = {}  # (what, job) -> (session, value): analyses made once per job and session


def _once(what: str, spark, job: Job, build):
    cached = _PER_SESSION.get((what, job))
    if cached is None or cached[0] is not spark:
        cached = _PER_SESSION[(what, job)] = (spark, build())
    return cached[1]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    return first if len(first) <= 240 else first[:237] + "..."


def transformed(job: Job, events: DataFrame) -> DataFrame:
    """``job.transform(events)``, with an analysis failure turned into one line naming the job."""
    try:
        out = job.transform(events)
        out.schema  # noqa: B018 - forces analysis
    except DeclarationError:
        raise
    except Exception as exc:  # noqa: BLE001 - AnalysisException and friends, translated
        raise DeclarationError(
            f"job {job.name}: its transform fails on the fields of {', '.join(s.name for s in job.sources)} "
            f"({', '.join(events.columns)}): {_first_line(exc)}"
        ) from None
    needed = (*job.keys, job.source.event_time, job.source.dedup_key)
    missing = [c for c in needed if c not in out.columns]
    if missing:
        raise DeclarationError(
            f"job {job.name}: transform output lacks column(s) {missing}; it must keep the keys, the "
            f"event-time column and the dedup key (it produces {', '.join(out.columns)})"
        )
    return out


def _check_aggregates(job: WindowedJob, schema: T.StructType) -> None:
    columns = schema.names
    for agg in job.aggregates:
        if agg.kind == "count" and agg.column == "*":
            continue
        call = f"Agg.{agg.kind}({agg.column!r}{', ' + repr(agg.name) if agg.name != agg.column else ''})"
        if agg.column not in columns:
            raise DeclarationError(
                f"job {job.name}: aggregate {call} reads column {agg.column!r}, which the transform does not "
                f"produce; its columns are {', '.join(columns)}"
            )
        dtype = schema[agg.column].dataType
        if agg.kind in ("sum", "count") and not isinstance(dtype, (T.NumericType, T.BooleanType)):
            raise DeclarationError(
                f"job {job.name}: aggregate {call} sums column {agg.column!r} of type {dtype.simpleString()}; "
                "sum needs a number (cast it in the transform, or use Agg.min/Agg.max)"
            )
        if agg.kind in ("avg", "percentile") and not isinstance(dtype, T.NumericType):
            raise DeclarationError(
                f"job {job.name}: aggregate {call} reads column {agg.column!r} of type {dtype.simpleString()}; "
                f"{agg.kind} needs a number (cast it in the transform)"
            )
        if agg.kind != "count" and isinstance(dtype, (T.MapType, T.ArrayType, T.StructType, T.BinaryType)) \
                and agg.kind not in ("first", "last"):
            raise DeclarationError(
                f"job {job.name}: aggregate {call} reads column {agg.column!r} of type {dtype.simpleString()}; "
                f"{agg.kind} needs a plain value (a number, text, date or time)"
            )


def _check_having(job: WindowedJob, spark, window_schema: T.StructType) -> None:
    frame = spark.createDataFrame([], window_schema)
    try:
        predicate_type = frame.select(F.expr(job.having).alias("_p")).schema["_p"].dataType
    except Exception as exc:  # noqa: BLE001 - ParseException/AnalysisException, translated
        raise DeclarationError(
            f"job {job.name}: having {job.having!r} is not a valid predicate over the window's columns "
            f"({', '.join(window_schema.names)}): {_first_line(exc)}"
        ) from None
    if not isinstance(predicate_type, T.BooleanType):
        raise DeclarationError(
            f"job {job.name}: having {job.having!r} is a {predicate_type.simpleString()}, not a condition; "
            f"write a comparison such as 'declined > 5'"
        )


def validate(spark, job: Job, events: DataFrame) -> None:
    """Refuse a declaration Spark cannot run (``events``: the typed events of its sources, e.g. empty)."""
    key = (job, id(spark))
    if key in _CHECKED:
        return
    out = transformed(job, events)
    if isinstance(job, WindowedJob):
        _check_aggregates(job, out.schema)
        if job.having:

            fields = [out.schema[k] for k in job.keys]
            fields += [T.StructField("window_start", T.TimestampType()), T.StructField("window_end", T.TimestampType())]
            fields += [T.StructField(a.name, aggregate_type(a, out.schema)) for a in job.aggregates]
            _check_having(job, spark, T.StructType(fields))
    elif isinstance(job, KeyedJob):
        try:
            parse_ddl(job.output)
        except Exception as exc:  # noqa: BLE001
            raise DeclarationError(f"job {job.name}: output {job.output!r} is not a Spark DDL schema: "
                                   f"{_first_line(exc)}") from None
    _CHECKED.add(key)


def empty_events(spark, job: Job):
    """The typed events of the job's sources (every field, ``source``), empty: for analysis only. Built once
    per job and session (its plan is a few hundred expressions: ~0.3 s of a cold start each time)."""
    from .parse import LINE_COLUMNS, parse_sources

    def build():
        parsed = parse_sources(job, spark.createDataFrame([], RAW_SCHEMA))
        return parsed.where(parsed["_reason"].isNull()).drop(*LINE_COLUMNS)

    return _once("events", spark, job, build)


def check_job(spark, job: Job) -> None:
    """Refuse a declaration Spark cannot run, with one line, before anything starts."""
    if (job, id(spark)) not in _CHECKED:
        validate(spark, job, empty_events(spark, job))


def transformed_schema(spark, job: Job) -> T.StructType:
    """The columns the job's transform produces (Spark analyses it; no Spark job runs)."""
    return _once("schema", spark, job, lambda: transformed(job, empty_events(spark, job)).schema)
