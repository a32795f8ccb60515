"""Time, in one place: durations and instants read from user text at the edges (``timedelta`` and epoch
milliseconds inside), and the watermark's rules and rendering.

The watermark (bounded out-of-orderness ``d``) after a micro-batch is
``W_out = max(W_in, max event time of the batch - d)``: it only moves forward, once per micro-batch.
Before any event it is ``NEG_INF_MS``; a bounded run ends at ``POS_INF_MS`` (every window and timer fires).
"""

from __future__ import annotations

import re
from datetime import date, datetime, timedelta, timezone

from .errors import ConfigError, DateRangeError, DeclarationError

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|min|m|h|d)\s*$")


def parse_duration(text: str | int | float | timedelta, *, field: str = "duration") -> timedelta:
    """'250ms', '5s', '10m', '1h', '2d' (or a number of seconds, or a timedelta) -> timedelta."""
    if isinstance(text, timedelta):
        return text
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return timedelta(seconds=text)
    match = _DURATION.match(str(text))
    if not match:
        raise ConfigError(
            f"{field}: cannot read {text!r} as a duration; write it like '250ms', '5s', '10m', '1h' or '2d'"
        )
    return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])


def to_ms(delta: timedelta) -> int:
    """A timedelta as whole milliseconds."""
    return int(round(delta.total_seconds() * 1000))


def format_duration(delta: timedelta) -> str:
    """Shortest exact text for a duration: 300s -> '5m', 0.25s -> '250ms'."""
    ms = to_ms(delta)
    for unit, factor in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms and ms % factor == 0:
            return f"{ms // factor}{unit}"
    return f"{ms}ms"


def positive(name: str, value: timedelta) -> None:
    """Refuse a duration that is not a positive whole number of milliseconds, naming the field."""
    if not isinstance(value, timedelta):
        raise DeclarationError(f"{name} must be a timedelta, got {value!r}; e.g. timedelta(minutes=5)")
    if value <= timedelta(0):
        raise DeclarationError(f"{name} must be positive, got {format_duration(value)}")
    if to_ms(value) != value.total_seconds() * 1000:
        raise DeclarationError(f"{name} must be a whole number of milliseconds, got {value}")


def parse_instant(text: str | datetime | date, *, field: str = "time") -> datetime:
    """An ISO-8601 date or date-time (UTC unless it says otherwise) -> aware UTC datetime."""
    if isinstance(text, datetime):
        value = text
    elif isinstance(text, date):
        value = datetime(text.year, text.month, text.day)
    else:
        raw = str(text).strip()
        try:
            value = datetime.fromisoformat(raw.replace("Z", "+00:00"))
        except ValueError:
            raise DateRangeError(
                f"{field}: cannot read {raw!r} as a date or time; use ISO-8601 like 2026-11-20 or 2026-11-20T13:00:00Z"
            ) from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)


def epoch_ms(moment: datetime) -> int:
    return int(round(moment.timestamp() * 1000))


def from_epoch_ms(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


def iso_ms(moment: datetime) -> str:
    """ISO-8601 UTC with milliseconds and a Z, the landing zone's event_time format."""
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


# -- the watermark -------------------------------------------------------------------------------

NEG_INF_MS = -(2**62)  # the watermark before any event
POS_INF_MS = 2**62  # the watermark at the end of a bounded input
_FINITE_MS = 2**61  # any instant a clock or an event can hold is well inside this


def is_finite(ms: int | None) -> bool:
    """Whether ``ms`` is a real instant (not None, not one of the infinities)."""
    return ms is not None and -_FINITE_MS < ms < _FINITE_MS


def advance(watermark_in_ms: int, max_event_time_ms: int | None, out_of_orderness_ms: int) -> int:
    """``W_out = max(W_in, max event time - d)``; a batch without events leaves the watermark where it was."""
    if max_event_time_ms is None:
        return watermark_in_ms
    return max(watermark_in_ms, max_event_time_ms - out_of_orderness_ms)


def as_datetime(ms: int | None) -> datetime | None:
    """A finite instant as an aware UTC datetime; None for no value or an infinity."""
    return from_epoch_ms(ms) if is_finite(ms) else None


def describe_watermark(ms: int | None) -> str:
    """A watermark for people: ``-inf (no events yet)``, ``+inf (end of input)`` or ISO-8601 UTC."""
    if ms is None or ms <= -_FINITE_MS:
        return "-inf (no events yet)"
    if ms >= _FINITE_MS:
        return "+inf (end of input)"
    return iso_ms(from_epoch_ms(ms))


def short_watermark(ms: int | None) -> str:
    """A watermark in a table cell: ``-`` (none yet), ``+inf`` or ISO-8601 UTC."""
    if ms is None or ms <= -_FINITE_MS:
        return "-"
    return "+inf" if ms >= _FINITE_MS else iso_ms(from_epoch_ms(ms))
