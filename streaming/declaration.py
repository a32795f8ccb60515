"""A job is declared once, as plain frozen data; the stream runner and the bounded runner read it.

Time semantics (the same in stream and in batch):

* **Windows** are half-open ``[start, end)`` in event time (see ``windows``).
* **Watermark** (bounded out-of-orderness ``d``): after a micro-batch, the watermark is
  ``W = max(W_previous, max event time seen so far - d)``. It only moves forward, once per
  micro-batch (Spark's granularity), and is stored with the batch so a replay sees the same value.
* A window **fires** (its row is written to the sink) as soon as ``W >= end``. With an
  **allowed lateness** ``L`` the window stays in state until ``W >= end + L``; an event for it
  that arrives meanwhile updates it and the sink row is **corrected** (an upsert on keys and
  ``window_start``; merged sessions retract the rows they replace).
* An event is **late** for a window when ``end + L <= W`` at the start of the micro-batch that
  delivered it (for sessions, the event's own window ``[t, t + gap)``). Late events are never
  dropped silently: they go to the job's late side output (``<table>_late``), one row per missed
  window, with ``window_start``, ``window_end``, ``watermark_ms`` and
  ``late_by_ms = watermark_ms - event_time_ms``.
* **Bounded runs** (backfills) have a perfect watermark: nothing is late, and at end of input the
  watermark jumps to +infinity, so every window fires (Flink's batch execution of a bounded stream).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Literal

from .errors import DeclarationError
from .io.sources import FORMATS, kind_of
from .keyed.function import EVENT_TIME, PROCESSING_TIME, KeyedProcessFunction, declared_state
from .time import positive, to_ms
from .windows import Window


@dataclass(frozen=True)
class Watermark:
    """Bounded out-of-orderness watermark plus Flink's separate allowed lateness."""

    out_of_orderness: timedelta
    allowed_lateness: timedelta = timedelta(0)

    def __post_init__(self) -> None:
        if not isinstance(self.out_of_orderness, timedelta) or self.out_of_orderness < timedelta(0):
            raise DeclarationError(
                f"Watermark.out_of_orderness must be a timedelta >= 0, got {self.out_of_orderness!r}"
            )
        if not isinstance(self.allowed_lateness, timedelta) or self.allowed_lateness < timedelta(0):
            raise DeclarationError(
                f"Watermark.allowed_lateness must be a timedelta >= 0, got {self.allowed_lateness!r}"
            )

    @property
    def out_of_orderness_ms(self) -> int:
        return to_ms(self.out_of_orderness)

    @property
    def allowed_lateness_ms(self) -> int:
        return to_ms(self.allowed_lateness)


AggKind = Literal["sum", "min", "max", "count", "avg", "count_distinct", "approx_count_distinct", "first", "last",
                  "percentile"]
AGG_KINDS = ("sum", "min", "max", "count", "avg", "count_distinct", "approx_count_distinct", "first", "last",
             "percentile")
# The stated accuracy of the approximate aggregates (see ``streaming.windowed.aggregates``).
APPROX_DISTINCT_ERROR = 0.0163  # HyperLogLog with 4,096 registers: relative standard error 1.04 / sqrt(4096)
PERCENTILE_ERROR = 0.01  # log-bucketed histogram: every value within 1 % of the true one (relative)


@dataclass(frozen=True)
class Agg:
    """A mergeable aggregate of one measure column (partial results combine across batches, corrections
    and the bounded twin alike).

    ``count`` (rows; of a column: its sum, for 0/1 flags), ``sum``, ``min``, ``max``, ``avg``, ``count_distinct``
    (exact: a window keeps its distinct values), ``approx_count_distinct`` (HyperLogLog: relative standard error
    1.6 %, a window keeps at most 4,096 small registers), ``first`` / ``last`` (the value of the window's
    earliest / latest event by event time, ties broken by the dedup key; NULL values skipped) and
    ``percentile`` (``q`` in (0, 1]: the value at rank ceil(q * n) of the window's values, within 1 % of it,
    relative). NULL values are skipped by every aggregate but ``count``.
    """

    kind: AggKind
    column: str
    name: str = ""
    q: float | None = None  # percentile: the quantile

    def __post_init__(self) -> None:
        if self.kind not in AGG_KINDS:
            raise DeclarationError(f"Agg.kind must be one of {', '.join(AGG_KINDS)}, got {self.kind!r}")
        if self.kind == "percentile":
            if not isinstance(self.q, (int, float)) or isinstance(self.q, bool) or not 0 < self.q <= 1:
                raise DeclarationError(f"Agg.percentile({self.column!r}): q must be a number in (0, 1], e.g. 0.95 "
                                       f"for the 95th percentile; got {self.q!r}")
        elif self.q is not None:
            raise DeclarationError(f"Agg.{self.kind}({self.column!r}) takes no q (only Agg.percentile does)")
        if self.column == "*" and self.kind != "count":
            raise DeclarationError(f"Agg.{self.kind} needs a column; only Agg.count counts rows ('*')")
        if not self.name:
            object.__setattr__(self, "name", self.column)

    def describe(self) -> list:
        """What the aggregate is, as plain data (part of a job's shape)."""
        return [self.kind, self.column, self.name] + ([self.q] if self.q is not None else [])

    @staticmethod
    def sum(column: str, name: str = "") -> "Agg":
        return Agg("sum", column, name)

    @staticmethod
    def count(name: str) -> "Agg":
        return Agg("count", "*", name)

    @staticmethod
    def min(column: str, name: str = "") -> "Agg":
        return Agg("min", column, name)

    @staticmethod
    def max(column: str, name: str = "") -> "Agg":
        return Agg("max", column, name)

    @staticmethod
    def avg(column: str, name: str = "") -> "Agg":
        """The mean of the window's non-NULL values (a decimal(p,s) column: decimal(p+4,s+4); else a double)."""
        return Agg("avg", column, name)

    @staticmethod
    def count_distinct(column: str, name: str = "", *, approximate: bool = False) -> "Agg":
        """The number of distinct non-NULL values: exact, or (``approximate``) HyperLogLog's estimate, whose
        relative standard error is 1.6 % (within 5 % in 99.7 % of windows) and whose state stays small."""
        return Agg("approx_count_distinct" if approximate else "count_distinct", column, name)

    @staticmethod
    def first(column: str, name: str = "") -> "Agg":
        """The value of the window's earliest event (event time; ties: the smallest dedup key)."""
        return Agg("first", column, name)

    @staticmethod
    def last(column: str, name: str = "") -> "Agg":
        """The value of the window's latest event (event time; ties: the largest dedup key)."""
        return Agg("last", column, name)

    @staticmethod
    def percentile(column: str, q: float, name: str = "") -> "Agg":
        """The ``q``-quantile of the window's values (a double within 1 % of the value at rank ceil(q * n))."""
        return Agg("percentile", column, name, q)


FIELD_TYPES = ("string", "int", "long", "double", "decimal", "decimal(p,s)", "boolean", "date", "timestamp", "enum",
               "ip")
_DECIMAL_TYPE = re.compile(r"^decimal\(\s*([0-9]{1,2})\s*,\s*([0-9]{1,2})\s*\)$")


@dataclass(frozen=True)
class Field:
    """One field of a landing-zone record and the rule it must satisfy.

    ``type``: ``string`` (optionally with a regular-expression ``pattern``), ``int``, ``long``,
    ``double``, ``decimal(p,s)``, ``boolean`` (true/false), ``date`` (YYYY-MM-DD), ``timestamp``
    (ISO 8601 with a zone), ``enum`` (one of ``choices``) or ``ip`` (IPv4). A bare ``decimal`` is a
    non-negative money amount, decimal(18,2). ``required=False`` lets the field be missing or null;
    a present value must still satisfy the rule. A record that breaks a rule goes to the source's
    quarantine table with the reason.
    """

    name: str
    type: str
    choices: tuple[str, ...] = ()
    pattern: str | None = None
    required: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise DeclarationError(f"field name {self.name!r} must be an identifier, e.g. device_id")
        kind = self.kind
        if kind not in FIELD_TYPES:
            raise DeclarationError(f"field {self.name}: unknown type {self.type!r}; use one of {', '.join(FIELD_TYPES)}")
        if kind == "decimal(p,s)":
            precision, scale = self.precision_scale
            if not 1 <= precision <= 38 or scale > precision:
                raise DeclarationError(f"field {self.name}: {self.type} needs 1 <= precision <= 38 and scale <= precision")
        if kind == "enum" and not (self.choices and all(isinstance(c, str) for c in self.choices)):
            raise DeclarationError(f"field {self.name}: an enum needs choices, e.g. choices=('ON', 'OFF')")
        if kind != "enum" and self.choices:
            raise DeclarationError(f"field {self.name}: choices apply to enum fields, not {self.type}")
        if self.pattern is not None:
            if kind != "string":
                raise DeclarationError(f"field {self.name}: a pattern applies to string fields, not {self.type}")
            try:
                re.compile(self.pattern)
            except re.error as exc:
                raise DeclarationError(f"field {self.name}: pattern {self.pattern!r} is not a regular expression: {exc}") from None

    @property
    def kind(self) -> str:
        """The type's family: ``decimal(10,3)`` -> ``decimal(p,s)``."""
        text = str(self.type).strip().lower()
        return "decimal(p,s)" if _DECIMAL_TYPE.match(text) else text

    @property
    def precision_scale(self) -> tuple[int, int]:
        match = _DECIMAL_TYPE.match(str(self.type).strip().lower())
        return (int(match.group(1)), int(match.group(2))) if match else (18, 2)


@dataclass(frozen=True)
class Table:
    """A lake table ``lake.<namespace>.<name>``; Iceberg or Delta is chosen by configuration."""

    name: str

    def __post_init__(self) -> None:
        parts = self.name.split(".")
        if len(parts) != 3 or parts[0] != "lake" or not all(p.isidentifier() for p in parts):
            raise DeclarationError(f"table name {self.name!r} must look like lake.<namespace>.<table>")

    @property
    def namespace(self) -> str:
        return ".".join(self.name.split(".")[:2])

    @property
    def domain(self) -> str:
        return self.name.split(".")[1]

    @property
    def short(self) -> str:
        return self.name.split(".", 1)[1]

    def side(self, suffix: str) -> "Table":
        return Table(f"{self.name}_{suffix}")


@dataclass(frozen=True)
class Source:
    """A folder of files in the landing zone, filled in arrival order (a file, once there, is not changed).

    ``format``: ``json`` (JSON lines, one object per line), ``csv`` (one record per line, the
    declared fields in order; ``header`` lines naming the fields are skipped; ``delimiter``) or
    ``parquet`` (columns by name; values are checked against the declared types like any other
    format). ``location``: the folder, absolute or relative to the settings' ``landing`` (default:
    the source's name).

    ``table``: an append-only lake table (``location="lake.<namespace>.<table>"``), typically the
    output of another lakestream job (bronze -> silver -> gold): the stream follows the table's
    appended snapshots (Spark's Iceberg streaming read), the bounded twin reads the table as of a
    snapshot. Columns by name, checked like any other format. ``dedup_from`` builds the dedup key
    from several columns (a table's natural key, e.g. ``("device_id", "hot_since")``) when the
    table has no id column of its own. Invalid records go to ``lake.quarantine.<name>`` with the reason. Dedup keys
    must be unique across the sources of one job (the generator prefixes them per source).
    """

    name: str
    fields: tuple[Field, ...]
    event_time: str = "event_time"
    dedup_key: str = "event_id"
    format: str = "json"
    location: str | None = None
    header: bool = True
    delimiter: str = ","
    description: str = ""
    dedup_from: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise DeclarationError(f"source name {self.name!r} must be an identifier, e.g. sensor_readings")
        if not isinstance(self.fields, tuple) or not self.fields or not all(isinstance(f, Field) for f in self.fields):
            raise DeclarationError(f"Source {self.name}: fields must be a non-empty tuple of Field")
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise DeclarationError(f"Source {self.name}: a field name is used twice in {names}")
        for required in (self.event_time, self.dedup_key):
            if required not in names:
                raise DeclarationError(f"Source {self.name}: {required!r} is not one of its fields {names}")
        by_name = {f.name: f for f in self.fields}
        if by_name[self.event_time].kind != "timestamp":
            raise DeclarationError(f"Source {self.name}: the event-time field {self.event_time!r} must be a timestamp")
        for key in (self.event_time, self.dedup_key):
            if not by_name[key].required:
                raise DeclarationError(f"Source {self.name}: {key!r} (event time / dedup key) must be required")
        if self.format not in FORMATS:
            raise DeclarationError(f"Source {self.name}: format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        kind = kind_of(self.format)
        kind.check(self)  # what the source's kind requires (a table source names its table...)
        if kind.upstream_table(self):
            Table(kind.upstream_table(self))  # lake.<namespace>.<table>
        if self.dedup_from:
            unknown = [c for c in self.dedup_from if c not in names or c == self.dedup_key]
            if not isinstance(self.dedup_from, tuple) or unknown:
                raise DeclarationError(f"Source {self.name}: dedup_from must be a tuple of its other fields, "
                                       f"got {self.dedup_from!r}")
            if by_name[self.dedup_key].kind != "string":
                raise DeclarationError(f"Source {self.name}: the dedup key {self.dedup_key!r} built from "
                                       f"{self.dedup_from} must be a string field")
        if not isinstance(self.delimiter, str) or len(self.delimiter) != 1 or self.delimiter in "\"\n\r":
            raise DeclarationError(f"Source {self.name}: delimiter must be one character (not a quote), got {self.delimiter!r}")

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @property
    def quarantine(self) -> Table:
        return Table(f"lake.quarantine.{self.name}")


def _check_sources(job: str, sources: tuple[Source, ...]) -> None:
    if not sources or not all(isinstance(s, Source) for s in sources):
        raise DeclarationError(f"job {job}: sources must be a non-empty tuple of Source, e.g. sources=(PAYMENTS,)")
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise DeclarationError(f"job {job}: a source is listed twice in {names}")
    first = sources[0]
    for s in sources[1:]:
        if (s.event_time, s.dedup_key) != (first.event_time, first.dedup_key):
            raise DeclarationError(f"job {job}: all sources must share the event-time column and the dedup key")
        common = {f.name: f.precision_scale if f.kind.startswith("decimal") else f.kind for f in first.fields}
        clash = [f.name for f in s.fields
                 if f.name in common and common[f.name] != (f.precision_scale if f.kind.startswith("decimal") else f.kind)]
        if clash:
            raise DeclarationError(f"job {job}: field(s) {clash} have different types in {first.name} and {s.name}")


def _check_name(name: str) -> None:
    if not name.isidentifier():
        raise DeclarationError(f"job name {name!r} must be a Python identifier, e.g. purchase_metrics")


def _digest(shape: dict) -> str:
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class WindowedJob:
    """An event-time windowed aggregation, declared once, run as a stream or bounded.

    ``transform`` maps the frame of valid, deduplicated events of all ``sources`` (unioned by
    column name, with a ``source`` column) to a frame holding the ``keys``, the event-time
    column (unchanged), the dedup key and the measure columns that ``aggregates`` read; it may
    filter rows. It must be deterministic and work unchanged on streaming and batch DataFrames
    (column expressions; no actions, no ``now()``). ``having`` (a SQL predicate over the
    aggregates, e.g. ``"declined > 5"``) keeps only the windows that satisfy it.
    """

    name: str
    sources: tuple[Source, ...]
    keys: tuple[str, ...]
    window: Window
    watermark: Watermark
    transform: Callable = field(compare=False, hash=False)
    aggregates: tuple[Agg, ...]
    sink: Table
    having: str | None = None
    dedup_ttl: timedelta = timedelta(minutes=30)
    description: str = ""
    owner: str = "data-platform"

    kind = "windowed"

    def __post_init__(self) -> None:
        _check_name(self.name)
        _check_sources(self.name, self.sources)
        if not isinstance(self.window, Window):
            raise DeclarationError(f"job {self.name}: window must be Tumbling, Sliding or Session, got {self.window!r}")
        if not self.keys:
            raise DeclarationError(f"job {self.name}: keys must name at least one column, e.g. keys=('user_id',)")
        if not self.aggregates:
            raise DeclarationError(f"job {self.name}: aggregates must not be empty")
        names = [a.name for a in self.aggregates]
        clash = set(names) & (set(self.keys) | {"window_start", "window_end"})
        if len(set(names)) != len(names) or clash:
            raise DeclarationError(f"job {self.name}: aggregate names must be unique and differ from keys, got {names}")
        positive(f"job {self.name}: dedup_ttl", self.dedup_ttl)

    @property
    def source(self) -> Source:
        return self.sources[0]

    @property
    def late_sink(self) -> Table:
        return self.sink.side("late")

    @property
    def upserts(self) -> bool:
        """True when a window can be written more than once (corrections, retractions)."""
        return self.watermark.allowed_lateness_ms > 0

    def shape(self) -> dict:
        """Everything that shapes the job's state (keys, window, aggregates), as plain data."""
        return {
            "kind": self.kind,
            "keys": list(self.keys),
            "window": self.window.describe(),
            "aggregates": [a.describe() for a in self.aggregates],
            "source": ",".join(s.name for s in self.sources),
            "dedup_key": self.source.dedup_key,
        }

    def fingerprint(self) -> str:
        """A stable hash of :meth:`shape`."""
        return _digest(self.shape())


@dataclass(frozen=True)
class KeyedJob:
    """Custom keyed logic (a :class:`KeyedProcessFunction`) with state, timers and TTL.

    ``transform`` maps valid events (as for :class:`WindowedJob`) to the rows the function
    receives; it must keep the keys, the event-time column and the dedup key. ``output`` is the
    schema of the rows the function emits (Spark DDL), ``time_column`` the output column that
    says which event time a row is about (partitioning, backfill ranges). ``history`` is how much
    event time before a range a bounded run replays to rebuild the state the range starts with.
    """

    name: str
    sources: tuple[Source, ...]
    keys: tuple[str, ...]
    watermark: Watermark
    transform: Callable = field(compare=False, hash=False)
    function: type
    output: str
    time_column: str
    sink: Table
    history: timedelta
    timers: str = EVENT_TIME
    dedup_ttl: timedelta = timedelta(minutes=30)
    description: str = ""
    owner: str = "data-platform"

    kind = "keyed"

    def __post_init__(self) -> None:
        _check_name(self.name)
        _check_sources(self.name, self.sources)
        if not self.keys:
            raise DeclarationError(f"job {self.name}: keys must name at least one column, e.g. keys=('card_id',)")
        if not (isinstance(self.function, type) and issubclass(self.function, KeyedProcessFunction)):
            raise DeclarationError(f"job {self.name}: function must be a KeyedProcessFunction subclass, got {self.function!r}")
        if self.timers not in (EVENT_TIME, PROCESSING_TIME):
            raise DeclarationError(f"job {self.name}: timers must be EVENT_TIME or PROCESSING_TIME, got {self.timers!r}")
        if self.watermark.allowed_lateness_ms:
            raise DeclarationError(
                f"job {self.name}: allowed_lateness applies to windows; a keyed function receives its elements in "
                "event-time order, so an element behind the watermark is late. Use Watermark(out_of_orderness=...) only"
            )
        columns = [c.strip().split()[0].strip("`") for c in self.output.split(",") if c.strip()]
        if self.time_column not in columns:
            raise DeclarationError(f"job {self.name}: time_column {self.time_column!r} is not an output column {columns}")
        if not isinstance(self.history, timedelta) or self.history < timedelta(0):
            raise DeclarationError(f"job {self.name}: history must be a timedelta >= 0, e.g. timedelta(hours=24)")
        positive(f"job {self.name}: dedup_ttl", self.dedup_ttl)

    @property
    def source(self) -> Source:
        return self.sources[0]

    @property
    def late_sink(self) -> Table:
        return self.sink.side("late")

    @property
    def upserts(self) -> bool:
        return False

    @property
    def output_columns(self) -> list[str]:
        return [c.strip().split()[0].strip("`") for c in self.output.split(",") if c.strip()]

    def state(self) -> dict:
        return declared_state(self.function)

    def shape(self) -> dict:
        return {
            "kind": self.kind,
            "keys": list(self.keys),
            "function": f"{self.function.__module__}.{self.function.__qualname__}",
            "state": sorted(d.describe() for d in self.state().values()),
            "timers": self.timers,
            "source": ",".join(s.name for s in self.sources),
            "dedup_key": self.source.dedup_key,
        }

    def fingerprint(self) -> str:
        return _digest(self.shape())


Job = WindowedJob | KeyedJob


def late_count(job: Job, n: int) -> str:
    """``n`` rows of ``job``'s late side output in words: a keyed job's (or a tumbling or session window's) late
    row is one late event; a sliding window's is an event and one window it missed, so rows can outnumber events."""
    if isinstance(job, KeyedJob) or getattr(job.window, "windows_per_event", 1) == 1:
        return f"{n:,} late event{'' if n == 1 else 's'}"
    return f"{n:,} late row{'' if n == 1 else 's'} (an event once per window it missed)"
