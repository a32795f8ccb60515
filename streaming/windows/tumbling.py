"""Tumbling windows: fixed, non-overlapping windows ``[k*size, (k+1)*size)`` of event time."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from ..time import format_duration, positive, to_ms
from .fixed import FixedWindows


@dataclass(frozen=True)
class Tumbling(FixedWindows):
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
