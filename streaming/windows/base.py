"""What every window kind answers. The engine, the backfill and the reconciliation ask these questions;
none of them asks which kind of window it holds.

A kind is a frozen dataclass (plain data: it is fingerprinted into checkpoints and savepoints) that
subclasses :class:`Window` and answers:

* **assignment** — which windows an event belongs to (:meth:`Window.assign`, Spark columns ``ws``/``we``);
* **combining** — how the partial aggregates of a window (its *pieces*) merge into its value
  (:meth:`Window.merge`: per window, or per set of pieces that overlap, as sessions do);
* **firing** — which windows a stream writes at the end of a micro-batch, given the watermark before
  and after it and what earlier batches left in the store (:meth:`Window.fire`);
* **lateness** — whether a batch's earliest event can be late at all (:meth:`Window.may_be_late`), and
  which windows of the stream a late row explains (:meth:`Window.late_windows`);
* **bounded runs** — the event range a bounded run needs for the windows starting in a range
  (:meth:`Window.events_for`), and before which time a stream at a watermark writes nothing more
  (:meth:`Window.final_horizon_ms`);
* **the store** — whether a store file of pieces may be dropped once the watermark has passed its end
  (:meth:`Window.pieces_expire`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from pyspark.sql import Column, DataFrame

WS, WE = "ws", "we"  # a row's window: start and end, epoch milliseconds, half-open [ws, we)


@dataclass
class Fired:
    """What a stream's batch writes to the main table (``rows``; with ``_op`` when the job upserts), and the
    frames the store keeps for later batches, by kind (``pieces``, and ``evals`` for sessions)."""

    rows: DataFrame | None = None
    store: dict[str, DataFrame] = field(default_factory=dict)


@dataclass
class Firing:
    """What a window kind is given to fire the windows of a stream's micro-batch.

    ``pieces``: this batch's partial aggregates of on-time events, one row per window (sessions: per
    merged interval) with ``keys``, ``ws``, ``we`` and one column per aggregate. ``store``: what earlier
    batches left (``in_range(kind, lo, hi)``: rows whose ``ws`` lies in ``[lo, hi]``; ``every(kind)``),
    None for the stream's first batch. ``aggregates``: how values combine, pass ``having`` and become
    sink rows (``streaming.windowed.aggregates.Aggregates``). ``cache``: keeps a frame that is read more
    than once until the batch ends, returns it as its cache."""

    keys: Sequence[str]
    lateness_ms: int
    watermark_in_ms: int
    watermark_out_ms: int
    batch_id: int
    pieces: DataFrame
    store: Any | None
    aggregates: Any
    upserts: bool
    having: bool
    cache: Callable[[DataFrame], DataFrame]


class Window(ABC):
    """A window kind (see the module)."""

    @abstractmethod
    def describe(self) -> str:
        """The declaration as text, e.g. ``Tumbling(size=5m)`` (part of a job's shape: checkpoints keep it)."""

    # -- assignment -----------------------------------------------------------------------------
    @abstractmethod
    def assign(self, frame: DataFrame, time_ms: Column) -> DataFrame:
        """``frame`` with ``ws``/``we``: one row per event and window it belongs to."""

    @property
    def cadence_ms(self) -> int:
        """How often a stream with steady input finishes a window of a key (the grid's step; sessions: the
        gap), what a reader of the table may expect new rows by."""
        return getattr(self, "every_ms", None) or getattr(self, "gap_ms", None) or 60_000

    @property
    def windows_per_event(self) -> int:
        """The most windows one event belongs to (sessions: the one interval it opens)."""
        return 1

    def one_window(self, time_ms: Column) -> tuple[Column, Column] | None:
        """Start and end of the one window of an event, for kinds where every event has exactly one (a
        single projection instead of :meth:`assign`); None otherwise."""
        return None

    # -- combining --------------------------------------------------------------------------------
    @abstractmethod
    def merge(self, pieces: DataFrame, keys: Sequence[str], combine: list[Column],
              extra: Sequence[Column] = ()) -> DataFrame:
        """One row per window with its value (``combine``: the aggregates' combining expressions;
        ``extra``: more aggregate columns to compute per window)."""

    # -- firing ---------------------------------------------------------------------------------
    @abstractmethod
    def fire(self, firing: Firing) -> Fired:
        """The main-table rows of the windows due at the end of a stream's micro-batch (see :class:`Firing`)."""

    # -- lateness -------------------------------------------------------------------------------
    @abstractmethod
    def may_be_late(self, earliest_event_ms: int, lateness_ms: int, watermark_ms: int) -> bool:
        """Whether a batch whose earliest event is at ``earliest_event_ms`` can hold a late (event, window):
        one whose window ends by ``watermark_ms - lateness_ms``."""

    @abstractmethod
    def late_windows(self, windows: DataFrame, late: DataFrame, keys: Sequence[str], event_time: str) -> DataFrame:
        """The windows among ``windows`` (``keys``, ``window_start``, ``window_end``) that rows of the late
        side output ``late`` explain: a stream was right to leave them without those events. Returns the
        distinct (``keys``, ``window_start``) of those windows."""

    # -- bounded runs ---------------------------------------------------------------------------
    @abstractmethod
    def events_for(self, lo_ms: int, hi_ms: int) -> tuple[int, int] | None:
        """The event times ``[lo, hi)`` a bounded run needs to compute every window starting in ``[lo_ms,
        hi_ms)`` whole; None when it needs every event."""

    @abstractmethod
    def final_horizon_ms(self, watermark_ms: int, lateness_ms: int, open_starts_ms: Sequence[int]) -> int:
        """The time before which every window *starting* there is final in a stream at ``watermark_ms`` (the
        stream writes none of them again). ``open_starts_ms``: where the pieces the stream still holds
        begin."""

    # -- the store ------------------------------------------------------------------------------
    def pieces_expire(self) -> bool:
        """Whether a store file of pieces can be dropped once ``end + lateness <= watermark`` for its latest
        window end (sessions: no, a later event can still extend a session that began in it)."""
        return True
