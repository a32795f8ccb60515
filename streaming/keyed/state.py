"""Keyed state, as Flink's ``ValueState``/``ListState``/``MapState`` with a ``StateTtlConfig``.

A descriptor names a state variable and declares its type (recorded in the job's shape, so a
change is detected before a checkpoint is resumed). ``RuntimeContext.get_state(descriptor)``
returns a handle; the handle always reads and writes the state of the *current key* (the key
whose element or timer is being processed), as in Flink.

**TTL is in event time** (Flink's TTL counts processing time): an entry written at event time
``t`` (the timestamp of the element or timer being processed) is expired from ``t + ttl`` on.
Expired entries are never returned, and they are removed when touched and when the key's
invocation ends. Event-time TTL keeps stream and bounded runs identical; a processing-time TTL
would make a backfill differ from the stream that it recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any, Callable, Iterator

from ..time import format_duration, to_ms
from ..errors import DeclarationError

# When the TTL clock of an entry restarts (Flink's StateTtlConfig.UpdateType).
ON_CREATE_AND_WRITE = "OnCreateAndWrite"
ON_READ_AND_WRITE = "OnReadAndWrite"


@dataclass(frozen=True)
class TtlConfig:
    """Expire a state entry ``ttl`` of event time after it was last written (or read)."""

    ttl: timedelta
    update_type: str = ON_CREATE_AND_WRITE

    def __post_init__(self) -> None:
        if not isinstance(self.ttl, timedelta) or self.ttl <= timedelta(0):
            raise DeclarationError(f"TtlConfig.ttl must be a positive timedelta, got {self.ttl!r}")
        if self.update_type not in (ON_CREATE_AND_WRITE, ON_READ_AND_WRITE):
            raise DeclarationError(
                f"TtlConfig.update_type must be ON_CREATE_AND_WRITE or ON_READ_AND_WRITE, got {self.update_type!r}"
            )

    @cached_property
    def ttl_ms(self) -> int:  # (read for every state access: converted once)
        return to_ms(self.ttl)

    def describe(self) -> str:
        return f"ttl={format_duration(self.ttl)}/{self.update_type}"


@dataclass(frozen=True)
class _Descriptor:
    name: str
    type: str  # Spark SQL type of the value(s), e.g. "decimal(18,2)", "long", "struct<t:long,a:double>"
    ttl: TtlConfig | None = None

    kind = "value"

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise DeclarationError(f"state name {self.name!r} must be an identifier, e.g. 'previous_amount'")
        if not isinstance(self.type, str) or not self.type.strip():
            raise DeclarationError(f"state {self.name}: type must be a Spark SQL type string, e.g. 'decimal(18,2)'")

    def describe(self) -> str:
        ttl = f", {self.ttl.describe()}" if self.ttl else ""
        return f"{self.kind} {self.name}: {self.type}{ttl}"


@dataclass(frozen=True)
class ValueStateDescriptor(_Descriptor):
    kind = "value"


@dataclass(frozen=True)
class ListStateDescriptor(_Descriptor):
    kind = "list"


@dataclass(frozen=True)
class MapStateDescriptor(_Descriptor):
    key_type: str = "string"
    kind = "map"


# -- declared types as plain numbers and text ---------------------------------------------------
# A key's state is pickled on every batch that touches the key. Pickling a UTC datetime costs ~4.7 us and a
# Decimal ~1.4 us (each a reduce call and a class looked up by name), an int or a str ~0.2 us; the value of
# large_amount_alerts (decimal, timestamp, string) took 7.5 us to pickle and 3.2 us to unpickle, 0.6 us
# each as numbers and text. So, as Flink serializes state by its declared type, a value of a declared
# timestamp, decimal or struct of them is stored as microseconds, text and tuples. Only values of exactly
# the expected Python type are encoded (an aware UTC datetime, a Decimal, a tuple of the struct's width);
# anything else is stored as it is, so what a function reads back is always what it wrote.

Codec = tuple[Callable[[Any], Any], Callable[[Any], Any]]
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_US = timedelta(microseconds=1)


class _AsIs(Exception):
    """A value the declared type's codec does not cover: it is stored as it is."""


def _encode_timestamp(value: Any) -> int:
    if type(value) is not datetime or value.tzinfo is not timezone.utc or value.fold:
        raise _AsIs
    return (value - _EPOCH) // _US


def _decode_timestamp(micros: int) -> datetime:
    return _EPOCH + timedelta(microseconds=micros)


def _encode_decimal(value: Any) -> str:
    if type(value) is not Decimal:
        raise _AsIs
    return str(value)  # exact: Decimal(str(d)) has d's digits, exponent and sign


def _fields(inner: str) -> list[str]:
    """A struct's field declarations, split at the commas outside brackets."""
    fields, depth, start = [], 0, 0
    for i, ch in enumerate(inner):
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif ch == "," and depth == 0:
            fields.append(inner[start:i])
            start = i + 1
    fields.append(inner[start:])
    return fields


def codec(type_string: str) -> Codec | None:
    """Encode/decode for a declared Spark SQL type (None: its values are stored as they are)."""
    t = type_string.strip().lower()
    if t == "timestamp":
        return _encode_timestamp, _decode_timestamp
    if t == "decimal" or t.startswith("decimal("):
        return _encode_decimal, Decimal
    if not (t.startswith("struct<") and t.endswith(">")):
        return None
    parts = []
    for field in _fields(t[len("struct<"):-1]):
        name_and_type = field.split(":", 1) if ":" in field else field.strip().split(None, 1)
        if len(name_and_type) != 2:
            return None
        parts.append(codec(name_and_type[1]))
    if not any(parts):
        return None
    width = len(parts)
    encoders = [(i, c[0]) for i, c in enumerate(parts) if c]
    decoders = [(i, c[1]) for i, c in enumerate(parts) if c]

    def encode(value: Any) -> list:
        if type(value) is not tuple or len(value) != width:
            raise _AsIs
        out = list(value)
        for i, to_plain in encoders:
            if out[i] is not None:
                out[i] = to_plain(out[i])
        return out

    def decode(plain: list) -> tuple:
        for i, from_plain in decoders:
            if plain[i] is not None:
                plain[i] = from_plain(plain[i])
        return tuple(plain)

    return encode, decode


_KINDS = (("v", "V"), ("l", "L"), ("m", "M"))  # (entries stored as they are, entries encoded) per kind


def _converted(kind: str, entry: Any, convert: Callable[[Any], Any]) -> Any:
    """A value's, list's or map's entry with each stored value passed through ``convert`` (None stays)."""
    if kind == "v":
        return (convert(entry[0]), entry[1])
    if kind == "l":
        return [(None if v is None else convert(v), stamp) for v, stamp in entry]
    return {k: (None if v is None else convert(v), stamp) for k, (v, stamp) in entry.items()}


class KeyStore:
    """All state of one key: values, lists, maps (entries with their TTL stamp), as plain data.

    ``now_ms`` is the event time of what is being processed; the runtime sets it. ``codecs`` (by state
    name) store values of declared types compactly (see ``codec``): encoded entries are kept apart
    (``V``, ``L``, ``M``) from entries stored as they are (``v``, ``l``, ``m``).
    """

    def __init__(self, data: dict | None = None, codecs: dict[str, Codec] | None = None):
        data = data or {}
        self.values: dict[str, tuple[Any, int]] = data.get("v", {})
        self.lists: dict[str, list[tuple[Any, int]]] = data.get("l", {})
        self.maps: dict[str, dict[Any, tuple[Any, int]]] = data.get("m", {})
        self.codecs = codecs or {}
        if "V" in data:
            self._unpack(data)
        self.now_ms = 0

    def _part(self, kind: str) -> dict:
        return {"v": self.values, "l": self.lists, "m": self.maps}[kind]

    def _unpack(self, data: dict) -> None:
        for kind, packed in _KINDS:
            part = self._part(kind)
            for name, entry in data[packed].items():
                part[name] = _converted(kind, entry, self.codecs[name][1])

    def dump(self) -> dict:
        if not self.codecs:
            return {"v": self.values, "l": self.lists, "m": self.maps}
        out: dict[str, dict] = {part: {} for pair in _KINDS for part in pair}
        for kind, packed in _KINDS:
            for name, entry in self._part(kind).items():
                c = self.codecs.get(name)
                try:
                    if c is None:
                        raise _AsIs
                    out[packed][name] = _converted(kind, entry, c[0])
                except _AsIs:
                    out[kind][name] = entry
        return out

    def is_empty(self) -> bool:
        return not (self.values or any(self.lists.values()) or any(self.maps.values()))

    def expire(self, descriptors: dict[str, _Descriptor], now_ms: int) -> None:
        """Drop every entry whose TTL has passed at event time ``now_ms``."""
        for name, d in descriptors.items():
            if d.ttl is None:
                continue
            limit = now_ms - d.ttl.ttl_ms
            if name in self.values and self.values[name][1] <= limit:
                del self.values[name]
            if name in self.lists:
                self.lists[name] = [e for e in self.lists[name] if e[1] > limit]
                if not self.lists[name]:
                    del self.lists[name]
            if name in self.maps:
                self.maps[name] = {k: e for k, e in self.maps[name].items() if e[1] > limit}
                if not self.maps[name]:
                    del self.maps[name]

    def next_expiry_ms(self, descriptors: dict[str, _Descriptor]) -> int | None:
        """The earliest event time at which some entry expires (None: nothing expires)."""
        soonest = None
        for name, d in descriptors.items():
            if d.ttl is None:
                continue
            value = self.values.get(name)
            stamps = [value[1]] if value is not None else []
            if name in self.lists:
                stamps += [e[1] for e in self.lists[name]]
            if name in self.maps:
                stamps += [e[1] for e in self.maps[name].values()]
            if stamps:
                at = min(stamps) + d.ttl.ttl_ms
                soonest = at if soonest is None else min(soonest, at)
        return soonest


class _Handle:
    """A state variable of the current key. Every element and timer reads and writes state several times,
    so the descriptor's name, TTL and update type are looked up once, here."""

    def __init__(self, descriptor: _Descriptor, holder: "StoreHolder"):
        self.descriptor = descriptor
        self._holder = holder
        self._name = descriptor.name
        self._ttl_ms = descriptor.ttl.ttl_ms if descriptor.ttl is not None else None
        self._touch = descriptor.ttl is not None and descriptor.ttl.update_type == ON_READ_AND_WRITE

    @property
    def _store(self) -> KeyStore:
        return self._holder.store

    def _alive(self, stamp: int) -> bool:
        return self._ttl_ms is None or self._holder.store.now_ms < stamp + self._ttl_ms


class StoreHolder:
    """Points the handles at the store of the key being processed."""

    store: KeyStore = KeyStore()


class ValueState(_Handle):
    def value(self) -> Any:
        """The value, or None when unset or expired."""
        store = self._holder.store
        entry = store.values.get(self._name)
        if entry is None or (self._ttl_ms is not None and store.now_ms >= entry[1] + self._ttl_ms):
            return None
        if self._touch:
            store.values[self._name] = (entry[0], store.now_ms)
        return entry[0]

    def update(self, value: Any) -> None:
        if value is None:
            self.clear()
        else:
            store = self._holder.store
            store.values[self._name] = (value, store.now_ms)

    def clear(self) -> None:
        self._holder.store.values.pop(self._name, None)


class ListState(_Handle):
    def _entries(self) -> list[tuple[Any, int]]:
        return [e for e in self._store.lists.get(self._name, ()) if self._alive(e[1])]

    def get(self) -> list:
        """The live elements, oldest first."""
        entries = self._entries()
        if self._touch and entries:
            entries = [(v, self._store.now_ms) for v, _ in entries]
            self._store.lists[self._name] = entries
        return [v for v, _ in entries]

    def __iter__(self) -> Iterator:
        return iter(self.get())

    def add(self, value: Any) -> None:
        store = self._holder.store
        store.lists.setdefault(self._name, []).append((value, store.now_ms))

    def add_all(self, values) -> None:
        for value in values:
            self.add(value)

    def update(self, values) -> None:
        """Replace the list (every element gets a fresh TTL stamp)."""
        self._store.lists[self._name] = [(v, self._store.now_ms) for v in values]

    def clear(self) -> None:
        self._store.lists.pop(self._name, None)


_NO_ENTRIES: dict = {}


class MapState(_Handle):
    def _map(self) -> dict:
        return self._holder.store.maps.setdefault(self._name, {})

    def get(self, key: Any) -> Any:
        store = self._holder.store
        entry = store.maps.get(self._name, _NO_ENTRIES).get(key)
        if entry is None or (self._ttl_ms is not None and store.now_ms >= entry[1] + self._ttl_ms):
            return None
        if self._touch:
            self._map()[key] = (entry[0], store.now_ms)
        return entry[0]

    def put(self, key: Any, value: Any) -> None:
        store = self._holder.store
        store.maps.setdefault(self._name, {})[key] = (value, store.now_ms)

    def contains(self, key: Any) -> bool:
        entry = self._holder.store.maps.get(self._name, _NO_ENTRIES).get(key)
        return entry is not None and self._alive(entry[1])

    def remove(self, key: Any) -> None:
        self._holder.store.maps.get(self._name, _NO_ENTRIES).pop(key, None)

    def items(self) -> list[tuple[Any, Any]]:
        return [(k, e[0]) for k, e in self._store.maps.get(self._name, _NO_ENTRIES).items() if self._alive(e[1])]

    def keys(self) -> list:
        return [k for k, _ in self.items()]

    def values(self) -> list:
        return [v for _, v in self.items()]

    def is_empty(self) -> bool:
        return not self.items()

    def clear(self) -> None:
        self._store.maps.pop(self._name, None)


HANDLES = {"value": ValueState, "list": ListState, "map": MapState}
