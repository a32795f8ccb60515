"""Durations and instants at the edges: parse user text once, keep `timedelta`/ms inside."""

from __future__ import annotations

import re
from datetime import date, datetime, timedelta, timezone

from .errors import ConfigError, DateRangeError

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
