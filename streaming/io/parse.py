"""Raw landing-zone lines -> typed events, or a quarantine reason. Never drops a line.

Input frame: ``value`` (the raw line: a JSON object, or a CSV record for CSV sources), ``source_file``
and optionally ``_problem`` (a reason found before parsing) and ``_arrival`` (the delivery's place in the
arrival order, see ``sources.base.arrival``). Output: the source's fields, typed
(see ``spark_type``), plus ``source_file``, ``_arrival`` (0 when not given), ``_reason``
(NULL for a valid record, else why it is quarantined) and ``_raw`` (the line, kept for invalid
records only). Works on streaming and batch
frames alike (column expressions only).
"""

from __future__ import annotations

import re

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from ..spark import pyworkers
from ..spark.columns import once, select
from ..declaration import Field, Source
from .sources.base import SOURCE

AMOUNT_TYPE = T.DecimalType(18, 2)
_DECIMAL = r"^[0-9]{1,12}(\.[0-9]{1,2})?$"  # a bare `decimal`: a non-negative amount, decimal(18,2)
_TIMESTAMP = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?(Z|[+-][0-9]{2}:[0-9]{2})$"
_DATE = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$"
_IPV4 = r"^((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])$"
_INT = r"^[+-]?[0-9]{1,10}$"
_LONG = r"^[+-]?[0-9]{1,19}$"
_DOUBLE = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]{1,3})?$"
_CORRUPT = "_corrupt"
PROBLEM = "_problem"  # raw frames may carry a reason of their own (e.g. an unreadable Parquet file)
ARRIVAL = "_arrival"  # and the order their records arrived in (see ``sources.base.arrival``)
LINE_COLUMNS = ("_raw", "_reason", ARRIVAL)  # the parse's columns about the line, not the event


def spark_type(field: Field) -> T.DataType:
    """The Spark type a field's valid values have after parsing."""
    kind = field.kind
    if kind in ("decimal", "decimal(p,s)"):
        return T.DecimalType(*field.precision_scale)
    return {"int": T.IntegerType(), "long": T.LongType(), "double": T.DoubleType(), "boolean": T.BooleanType(),
            "date": T.DateType(), "timestamp": T.TimestampType()}.get(kind, T.StringType())


def _decimal_rule(field: Field) -> str:
    precision, scale = field.precision_scale
    whole = f"[0-9]{{1,{max(precision - scale, 1)}}}"
    return f"^[+-]?{whole}$" if scale == 0 else f"^[+-]?{whole}(\\.[0-9]{{1,{scale}}})?$"


def _typed(field: Field, raw: Column, utc: bool) -> Column:
    """``utc``: the session's time zone is UTC."""
    kind = field.kind
    if kind == "timestamp":
        if not utc:
            return F.to_timestamp(raw)
        # Spark's cast of a value with a zone looks the zone up with two regular expressions compiled for each
        # value (a tenth of a 1M-line parse, profiled). A value in UTC ('...Z', the usual ISO-8601 form) is
        # cast without its 'Z' in the session's zone, UTC: the same instant for every value the rule accepts
        # (one it rejects is quarantined either way). Other offsets take Spark's cast.
        in_utc = raw.substr(F.length(raw), F.lit(1)) == F.lit("Z")
        return F.when(in_utc, raw.substr(F.lit(1), F.length(raw) - 1).cast("timestamp")).otherwise(F.to_timestamp(raw))
    if kind == "date":
        return F.to_date(raw, "yyyy-MM-dd")
    if kind == "boolean":
        return F.when(F.lower(raw) == "true", F.lit(True)).when(F.lower(raw) == "false", F.lit(False))
    if kind in ("int", "long", "double", "decimal", "decimal(p,s)"):
        return raw.cast(spark_type(field))
    return raw


def _checks(field: Field, raw: Column) -> tuple[str | None, Column | None]:
    """A present value's rule as (a regular expression it must match, else None; a Column true when it breaks
    the rest of the rule, else None): it breaks the rule when it does not match or the Column is true."""
    kind, typed = field.kind, F.col(f"_typed_{field.name}")
    if kind == "timestamp":
        return _TIMESTAMP, typed.isNull()
    if kind == "date":
        return _DATE, typed.isNull()
    if kind == "decimal":
        return _DECIMAL, None
    if kind == "decimal(p,s)":
        return _decimal_rule(field), typed.isNull()
    if kind in ("int", "long"):
        return (_INT if kind == "int" else _LONG), typed.isNull()
    if kind == "double":
        return _DOUBLE, typed.isNull() | F.isnan(typed) | (F.abs(typed) == float("inf"))
    if kind == "boolean":
        return None, typed.isNull()
    if kind == "enum":
        return None, ~raw.isin(*field.choices)
    if kind == "ip":
        return _IPV4, None
    return (field.pattern, None) if field.pattern else (None, F.length(raw) == 0)


def _violation(regex: str | None, rest: Column | None, raw: Column) -> Column | None:
    """True when a present value breaks the rule (``_checks``' two parts); None when there is nothing to check."""
    parts = ([~raw.rlike(regex)] if regex else []) + ([rest] if rest is not None else [])
    return None if not parts else parts[0] if len(parts) == 1 else parts[0] | parts[1]


# One regular expression for the whole record. Matching each field's rule on its own cost ~2 s of a 1M-line
# parse (every match decodes the value to a Java string and makes a matcher): the values, joined by a
# separator, are matched at once, and a record that does not match (a rare invalid one, or one with a
# missing value) is checked field by field, which finds its reason as before. Only a rule whose meaning
# cannot change inside the joined expression takes part: anchored at both ends, no inline flags or
# look-arounds (``(?``), no back-references (the groups' numbers shift).
_SEP = "\u0001"
_JOINABLE = re.compile(r"^\^(?!.*\(\?)(?!.*\\[0-9k]).*[^\\]\$$", re.S)


def _joinable(regex: str) -> str | None:
    """The rule as a part of the joined expression (matching the whole value), or None."""
    return f"(?:{regex[1:-1]})" if _JOINABLE.match(regex) else None


def _joined(parts: list[tuple[Column, str]]) -> Column:
    """True when every value is present and each matches its rule: the values joined by a character none of
    them holds (with one inside, a rule's match could straddle two values)."""
    plain = None  # every value present, and none holds the separator
    for raw, _ in parts:
        clean = F.instr(raw, _SEP) == 0  # (NULL for a missing value: the record is checked field by field)
        plain = clean if plain is None else plain & clean
    values = F.concat_ws(_SEP, *[raw for raw, _ in parts])
    return F.coalesce(plain, F.lit(False)) & values.rlike("^" + _SEP.join(rule for _, rule in parts) + "$")


def _rule(field: Field) -> str:
    kind = field.kind
    if kind == "enum":
        return f"one of {'|'.join(field.choices)}"
    if kind == "decimal":
        return "decimal"
    if kind == "string" and field.pattern and len(field.pattern) <= 40:
        return f"string matching {field.pattern}"
    if kind == "string":
        return "string"
    return str(field.type)


def _show(raw: Column) -> Column:
    return F.when(F.length(raw) > 40, F.concat(F.substring(raw, 1, 40), F.lit("..."))).otherwise(raw)


def parse(raw: DataFrame, source: Source, *, barrier: bool = True) -> DataFrame:
    """``raw``'s lines parsed and checked (see the module). ``barrier=False`` for a caller that caches the
    result before filtering it (see below): without the barrier, a 50k-line batch parsed ~10% faster."""
    by_header = source.format == "csv" and source.header
    if by_header:
        raw = with_csv_header(raw, source)
    utc = raw.sparkSession.conf.get("spark.sql.session.timeZone", None) in _UTC
    first, expand, typed, last = once(("parse", source, PROBLEM in raw.columns, ARRIVAL in raw.columns, HEADER in raw.columns, utc),
                                      lambda: _build(source, raw.columns, utc))
    parsed = select(select(raw, first), expand)
    # The result comes out of a Generate (``inline`` of a one-element array: one row out per line), so a
    # filter on it (valid rows, quarantined rows) cannot be pushed below the parse. Pushed through the
    # projections, Spark inlined ``from_json`` and the reason into the filter, parsed every line again,
    # interpreted (measured: the valid rows of 200k lines in 1.3 s instead of 0.7 s).
    parsed = select(select(parsed, typed), last)
    return parsed.select(F.inline(F.array(F.struct("*")))) if barrier else parsed


_UTC = {"UTC", "Etc/UTC", "GMT", "Etc/GMT", "Z", "+00:00"}  # (session time zones that are UTC)


def _build(source: Source, columns: list[str], utc: bool) -> tuple[list[Column], ...]:
    """The parse's column expressions (a few hundred nodes: built once per source and JVM, see ``columns``)."""
    schema = T.StructType(
        [T.StructField(f.name, T.StringType()) for f in source.fields] + [T.StructField(_CORRUPT, T.StringType())]
    )
    if source.format == "csv":
        parsed = F.from_csv("value", schema.simpleString(), {
            "sep": source.delimiter, "columnNameOfCorruptRecord": _CORRUPT, "mode": "PERMISSIVE"})
        malformed = f"malformed CSV: not {len(source.fields)} {source.delimiter!r}-separated values"
        blank = F.coalesce(F.length(F.trim(F.col("_raw"))) == 0, F.lit(True))
    else:  # json lines; a Parquet file's rows arrive as JSON objects too (see landing)
        parsed = F.from_json("value", schema, {"columnNameOfCorruptRecord": _CORRUPT, "mode": "PERMISSIVE"})
        malformed = "malformed JSON: not a JSON object"
        blank = F.col("_null")  # an empty or blank line parses to NULL
    # Expand the struct once: referencing `from_json(...).field` directly makes Spark parse the
    # line again for every reference (measured: 3x slower).
    problem = F.col(PROBLEM) if PROBLEM in columns else F.lit(None).cast("string")
    arrival = F.col(ARRIVAL) if ARRIVAL in columns else F.lit(0).cast("long")
    first = [F.col("value").alias("_raw"), F.col("source_file"), arrival.alias(ARRIVAL), parsed.alias("_j"),
             problem.alias(PROBLEM)]
    expand = [F.col(c) for c in ("_raw", "source_file", ARRIVAL, PROBLEM)] + [F.col("_j").isNull().alias("_null"),
                                                                              F.col("_j.*")]
    if HEADER in columns:  # CSV by its file's header: a field's value is the one in its named column
        first.append(F.col(HEADER))
        positional = F.array(*[F.col(f"_j.{f.name}") for f in source.fields])
        expand = expand[:-1] + [
            F.when(F.col(HEADER).isNull(), F.col(f"_j.{f.name}"))
            .otherwise(F.element_at(positional, F.greatest(F.array_position(F.col(HEADER), f.name).cast("int"), F.lit(1)))
                       ).alias(f.name) for f in source.fields] + [F.col(f"_j.{_CORRUPT}")]
    typed = [F.col("*")] + [_typed(f, F.col(f.name), utc).alias(f"_typed_{f.name}") for f in source.fields if f.kind != "string"]
    first_checks = [F.col(PROBLEM), F.when(blank | F.col(_CORRUPT).isNotNull(), F.lit(malformed))]
    checks, matched = list(first_checks), list(first_checks)  # (matched: when the joined expression matched)
    joined: list[tuple[Column, str]] = []
    for f in source.fields:
        raw_value = F.col(f.name)
        if f.required:
            missing = F.when(raw_value.isNull(), F.lit(f"missing field {f.name}"))
            checks.append(missing)
            matched.append(missing)
        regex, rest = _checks(f, raw_value)
        invalid = F.concat(F.lit(f"invalid {f.name} (expected {_rule(f)}): "), _show(raw_value))
        checks.append(F.when(raw_value.isNotNull() & _violation(regex, rest, raw_value), invalid))
        part = _joinable(regex) if regex else None
        if part is not None:
            joined.append((raw_value, part))
            regex = None  # (it matched)
        remaining = _violation(regex, rest, raw_value)
        if remaining is not None:
            matched.append(F.when(raw_value.isNotNull() & remaining, invalid))
    if len(joined) > 1:
        reason = F.when(_joined(joined), F.coalesce(*matched)).otherwise(F.coalesce(*checks))
    else:
        reason = F.coalesce(*checks)
    last = [
        *[(F.col(f"_typed_{f.name}") if f.kind != "string" else F.col(f.name)).alias(f.name) for f in source.fields],
        F.when(reason.isNotNull(), F.col("_raw")).alias("_raw"),  # keep the raw text only where it is needed
        F.col("source_file"),
        F.col(ARRIVAL),
        reason.alias("_reason"),
    ]
    return first, expand, typed, last


HEADER = "_header"  # a CSV line's file's header: its column names (NULL: a file without one, fields by position)
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HEADERS: dict[str, tuple[str, list[str]] | None] = {}  # per Python worker: file -> its header (files do not change)


def header_of(first_line: str, source: Source) -> list[str] | None:
    """The column names of a CSV file's first line, when that line is a header: every value a name, and at
    least half the source's fields among them (a data line has numbers, times or ids in it)."""
    import csv

    line = first_line.lstrip("\ufeff").rstrip("\r\n")
    try:
        values = [v.strip() for v in next(csv.reader([line], delimiter=source.delimiter))]
    except (csv.Error, StopIteration):
        return None
    if not values or not all(_IDENTIFIER.match(v) for v in values):
        return None
    known = sum(1 for v in values if v in source.field_names)
    return values if known >= max(1, -(-len(source.fields) // 2)) else None


def _read_first_line(path: str) -> str | None:
    if path.startswith("file:"):
        path = "/" + path[5:].lstrip("/")
    try:
        if "://" in path:
            import fsspec

            with fsspec.open(path, "rb") as f:
                data = f.readline(1 << 16)
        else:
            with open(path, "rb") as f:
                data = f.readline(1 << 16)
    except OSError:
        return None
    return data.decode("utf-8", errors="replace")


def with_csv_header(raw: DataFrame, source: Source) -> DataFrame:
    """``raw``'s CSV lines with their file's header (``HEADER``; NULL: the file has none): the first line of
    each file, read once per file and worker. The header line itself is no record and is dropped; a file
    whose header lacks a field or names a column the source does not declare is refused: each of its lines,
    header included, goes to the quarantine with a reason naming them."""
    import pandas as pd
    from pyspark.sql.functions import pandas_udf

    def headers(files):
        pyworkers.prepare()
        lines, names = [], []
        for path in files:
            if path not in _HEADERS:
                first = _read_first_line(path) if isinstance(path, str) else None
                found = header_of(first, source) if first is not None else None
                _HEADERS[path] = (first.lstrip("\ufeff").rstrip("\r\n"), found) if found else None
            got = _HEADERS[path]
            lines.append(got[0] if got else None)
            names.append(got[1] if got else None)
        return pd.DataFrame({"line": lines, "names": names})

    headers.__annotations__ = {"files": pd.Series, "return": pd.DataFrame}  # (this module's annotations are text)
    headers = pandas_udf(headers, "struct<line string, names array<string>>")

    declared = F.array(*[F.lit(n) for n in source.field_names])
    named = F.col("_found.names")
    unknown, missing = F.array_except(named, declared), F.array_except(declared, named)
    refused = F.when(named.isNotNull() & (F.size(unknown) + F.size(missing) > 0), F.concat(
        F.lit("CSV header "),
        F.when(F.size(unknown) > 0, F.concat(F.lit("names unknown column(s) "), F.array_join(unknown, ", "))).otherwise(F.lit("")),
        F.when((F.size(unknown) > 0) & (F.size(missing) > 0), F.lit(" and ")).otherwise(F.lit("")),
        F.when(F.size(missing) > 0, F.concat(F.lit("lacks "), F.array_join(missing, ", "))).otherwise(F.lit("")),
        F.lit(f": the file is refused (its columns must be the fields of {source.name}: {', '.join(source.field_names)})")))
    problem = F.col(PROBLEM) if PROBLEM in raw.columns else F.lit(None).cast("string")
    out = raw.select(F.col("*"), headers(F.col("source_file")).alias("_found")).select(
        *[F.col(c) for c in raw.columns if c != PROBLEM], F.coalesce(problem, refused).alias(PROBLEM),
        named.alias(HEADER), F.col("_found.line").alias("_header_line"))
    is_header = F.coalesce(F.col("value") == F.col("_header_line"), F.lit(False))
    return out.where(~is_header | F.col(PROBLEM).isNotNull()).drop("_header_line")


def parse_sources(job, raw: DataFrame, *, barrier: bool = True) -> DataFrame:
    """Every line of every source of ``job``: typed fields (unioned by name), ``source``, reasons
    (``barrier``: see :func:`parse`)."""
    frames = []
    for source in job.sources:
        lines = raw.where(F.col(SOURCE) == source.name) if len(job.sources) > 1 else raw
        frames.append(parse(lines, source, barrier=barrier).withColumn("source", F.lit(source.name)))
    parsed = frames[0]
    for frame in frames[1:]:
        parsed = parsed.unionByName(frame, allowMissingColumns=True)
    return parsed
