"""A job is declared once, as plain frozen data; the stream runner and the bounded runner read it.

Time semantics (the same in stream and in batch):

* **Windows** are half-open ``[start, end)`` in event time, aligned to the epoch (UTC).
  An event at exactly ``end`` belongs to the next window.
* **Watermark** (bounded out-of-orderness ``d``): after a micro-batch, the watermark is
  ``W = max(W_previous, max event time seen so far - d)``. It only moves forward, once per
  micro-batch (Spark's granularity), and is stored with the batch so a replay sees the same value.
* A window **fires** (its row is written to the sink) as soon as ``W >= end``.
* An event is **late** for a window when ``end + allowed_lateness <= W`` at the start of the
  micro-batch that delivered it. Late events are never dropped silently: they go to the job's late
  side output (``<table>_late``) with ``window_start``, ``window_end``, ``watermark_ms`` and
  ``late_by_ms = watermark_ms - event_time_ms``.
* **Bounded runs** (backfills) have a perfect watermark: nothing is late, and at end of input the
  watermark jumps to +infinity, so every window fires (Flink's batch execution of a bounded stream).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Literal

from .durations import format_duration, to_ms
from .errors import DeclarationError


def _positive(name: str, value: timedelta) -> None:
    if not isinstance(value, timedelta):
        raise DeclarationError(f"{name} must be a timedelta, got {value!r}; e.g. timedelta(minutes=5)")
    if value <= timedelta(0):
        raise DeclarationError(f"{name} must be positive, got {format_duration(value)}")
    if to_ms(value) != value.total_seconds() * 1000:
        raise DeclarationError(f"{name} must be a whole number of milliseconds, got {value}")


@dataclass(frozen=True)
class Tumbling:
    """Fixed, non-overlapping windows ``[k*size, (k+1)*size)`` of event time."""

    size: timedelta

    def __post_init__(self) -> None:
        _positive("Tumbling.size", self.size)

    @property
    def size_ms(self) -> int:
        return to_ms(self.size)

    @property
    def span_ms(self) -> int:
        """How far before a window's start its earliest event can lie (0: none before)."""
        return 0

    def describe(self) -> str:
        return f"Tumbling(size={format_duration(self.size)})"


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


AggKind = Literal["sum", "min", "max", "count"]


@dataclass(frozen=True)
class Agg:
    """A mergeable aggregate of one measure column (partial results combine across batches)."""

    kind: AggKind
    column: str
    name: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("sum", "min", "max", "count"):
            raise DeclarationError(f"Agg.kind must be sum, min, max or count, got {self.kind!r}")
        if not self.name:
            object.__setattr__(self, "name", self.column)

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


@dataclass(frozen=True)
class Field:
    """One field of a landing-zone record and the rule it must satisfy."""

    name: str
    type: Literal["string", "timestamp", "decimal", "enum", "ip"]
    choices: tuple[str, ...] = ()
    pattern: str | None = None


@dataclass(frozen=True)
class Source:
    """A folder of JSON-lines files in the landing zone, filled in arrival order."""

    name: str
    fields: tuple[Field, ...]
    event_time: str = "event_time"
    dedup_key: str = "event_id"

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        for required in (self.event_time, self.dedup_key):
            if required not in names:
                raise DeclarationError(f"Source {self.name}: {required!r} is not one of its fields {names}")

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)


@dataclass(frozen=True)
class IcebergTable:
    """An Iceberg table ``lake.<namespace>.<name>``."""

    name: str

    def __post_init__(self) -> None:
        parts = self.name.split(".")
        if len(parts) != 3 or parts[0] != "lake" or not all(parts):
            raise DeclarationError(f"table name {self.name!r} must look like lake.<namespace>.<table>")

    @property
    def namespace(self) -> str:
        return ".".join(self.name.split(".")[:2])

    @property
    def short(self) -> str:
        return self.name.split(".", 1)[1]

    def side(self, suffix: str) -> "IcebergTable":
        return IcebergTable(f"{self.name}_{suffix}")


@dataclass(frozen=True)
class WindowedJob:
    """An event-time windowed aggregation, declared once, run as a stream or bounded.

    ``transform`` maps a frame of valid, deduplicated source events to a frame holding the
    ``keys``, the source's event-time column and the measure columns that ``aggregates`` read.
    It must be deterministic and must work unchanged on streaming and batch DataFrames (use
    column expressions; no actions, no ``now()``).
    """

    name: str
    source: Source
    keys: tuple[str, ...]
    window: Tumbling
    watermark: Watermark
    transform: Callable = field(compare=False, hash=False)
    aggregates: tuple[Agg, ...]
    sink: IcebergTable
    quarantine: IcebergTable
    dedup_ttl: timedelta = timedelta(minutes=30)
    description: str = ""
    owner: str = "data-platform"

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise DeclarationError(f"job name {self.name!r} must be a Python identifier, e.g. purchase_metrics")
        if not self.keys:
            raise DeclarationError(f"job {self.name}: keys must name at least one column, e.g. keys=('user_id',)")
        if not self.aggregates:
            raise DeclarationError(f"job {self.name}: aggregates must not be empty")
        names = [a.name for a in self.aggregates]
        clash = set(names) & (set(self.keys) | {"window_start", "window_end"})
        if len(set(names)) != len(names) or clash:
            raise DeclarationError(f"job {self.name}: aggregate names must be unique and differ from keys, got {names}")
        _positive(f"job {self.name}: dedup_ttl", self.dedup_ttl)

    @property
    def late_sink(self) -> IcebergTable:
        return self.sink.side("late")

    def shape(self) -> dict:
        """Everything that shapes the job's state (keys, window, aggregates), as plain data."""
        return {
            "keys": list(self.keys),
            "window": self.window.describe(),
            "aggregates": [[a.kind, a.column, a.name] for a in self.aggregates],
            "source": self.source.name,
            "dedup_key": self.source.dedup_key,
        }

    def fingerprint(self) -> str:
        """A stable hash of :meth:`shape`."""
        return hashlib.sha256(json.dumps(self.shape(), sort_keys=True).encode()).hexdigest()[:16]
