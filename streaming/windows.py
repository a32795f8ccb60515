"""Window assigners over event time, as plain frozen data (the engine builds Spark expressions from them).

All windows are half-open, ``[start, end)``, in UTC milliseconds since the epoch.

* ``Tumbling(size)``: fixed, non-overlapping windows ``[k*size, (k+1)*size)``.
* ``Sliding(size, every)``: windows of length ``size`` starting every ``every``
  (``[k*every, k*every + size)``); an event belongs to every window that contains it, so to
  ``ceil(size / every)`` windows at most.
* ``Session(gap)``: per key, events closer than ``gap`` form one session. Each event opens the
  window ``[t, t + gap)``; windows of one key that overlap *or touch* merge (Flink's rule: two
  events exactly ``gap`` apart stay in one session, 1 ms more starts a new one). A session is
  ``[first event, last event + gap)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from .durations import format_duration, to_ms
from .errors import DeclarationError


def positive(name: str, value: timedelta) -> None:
    """Refuse a duration that is not a positive whole number of milliseconds, naming the field."""
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
        positive("Tumbling.size", self.size)

    @property
    def size_ms(self) -> int:
        return to_ms(self.size)

    @property
    def every_ms(self) -> int:
        return self.size_ms

    def events_for(self, lo_ms: int, hi_ms: int) -> tuple[int, int] | None:
        """The event times a bounded run needs to compute the windows starting in ``[lo, hi)``."""
        return lo_ms, hi_ms

    def describe(self) -> str:
        return f"Tumbling(size={format_duration(self.size)})"


@dataclass(frozen=True)
class Sliding:
    """Windows of ``size`` starting every ``every``: ``[k*every, k*every + size)``."""

    size: timedelta
    every: timedelta

    def __post_init__(self) -> None:
        positive("Sliding.size", self.size)
        positive("Sliding.every", self.every)
        if self.every > self.size:
            raise DeclarationError(
                f"Sliding(size={format_duration(self.size)}, every={format_duration(self.every)}): `every` must not "
                f"exceed `size` (windows would leave gaps); did you mean Tumbling(size={format_duration(self.size)})?"
            )

    @property
    def size_ms(self) -> int:
        return to_ms(self.size)

    @property
    def every_ms(self) -> int:
        return to_ms(self.every)

    @property
    def windows_per_event(self) -> int:
        return -(-self.size_ms // self.every_ms)

    def events_for(self, lo_ms: int, hi_ms: int) -> tuple[int, int] | None:
        # The last window starting before hi starts at (hi - every) at the latest and ends size later.
        return lo_ms, hi_ms - self.every_ms + self.size_ms

    def describe(self) -> str:
        return f"Sliding(size={format_duration(self.size)}, every={format_duration(self.every)})"


@dataclass(frozen=True)
class Session:
    """Per-key sessions of activity separated by at least ``gap`` of event time."""

    gap: timedelta

    def __post_init__(self) -> None:
        positive("Session.gap", self.gap)

    @property
    def gap_ms(self) -> int:
        return to_ms(self.gap)

    def events_for(self, lo_ms: int, hi_ms: int) -> tuple[int, int] | None:
        """None: a session starting in the range may chain events of any time after it (and the
        sessions before it decide where it starts), so a bounded run reads every event."""
        return None

    def describe(self) -> str:
        return f"Session(gap={format_duration(self.gap)})"


Window = Tumbling | Sliding | Session
