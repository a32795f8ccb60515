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

    def describe(self) -> str:
        return f"Tumbling(size={format_duration(self.size)})"
