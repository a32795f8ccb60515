"""Sliding (hopping) windows: windows of ``size`` starting every ``every``, ``[k*every, k*every + size)``."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from ..errors import DeclarationError
from ..time import format_duration, positive, to_ms
from .fixed import FixedWindows


@dataclass(frozen=True)
class Sliding(FixedWindows):
    """Windows of ``size`` starting every ``every``: ``[k*every, k*every + size)``; an event belongs to every
    window that contains it."""

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

    def describe(self) -> str:
        return f"Sliding(size={format_duration(self.size)}, every={format_duration(self.every)})"
