"""``KeyedProcessFunction``: custom per-key logic with state and timers, in Flink's shape.

    class Alert(KeyedProcessFunction):
        def open(self, ctx: RuntimeContext) -> None:
            self.previous = ctx.get_state(ValueStateDescriptor("previous", "decimal(18,2)",
                                                               ttl=TtlConfig(timedelta(hours=24))))

        def process_element(self, payment, ctx: Context):
            before = self.previous.value()
            if before is not None and payment.amount > 10 * before:
                yield {"card_id": ctx.get_current_key()[0], "amount": payment.amount}
            self.previous.update(payment.amount)

Semantics (the same in a stream and in a bounded run):

* Elements of a key reach ``process_element`` **in event-time order** (ties by dedup key), once
  the watermark has passed them, as Flink's CEP operator does: a stream buffers an element until
  ``watermark >= event time``. An element that arrives with ``event time <= watermark`` cannot
  take its place in that order: it is *late* and goes to the job's late side output.
* An event-time timer for ``T`` fires after every element with ``event time <= T`` and before
  any element with ``event time > T`` (``on_timer`` runs once per key and timestamp).
* Processing-time timers fire at the first micro-batch whose start time (recorded in the
  checkpoint, so a replay sees the same time) is ``>= T``; a job using them declares
  ``timers=PROCESSING_TIME``. In a bounded run they fire at end of input.
* In a bounded run the watermark is perfect: nothing is late, and at end of input every
  event-time timer fires (Flink's batch execution of a bounded stream).
* ``process_element`` and ``on_timer`` return (or yield) output rows: tuples in the order of
  the job's output schema, or dicts by column name.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any, Iterable, Union

from ..errors import DeclarationError
from .state import HANDLES, StoreHolder, _Descriptor

EVENT_TIME = "event_time"
PROCESSING_TIME = "processing_time"

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MS = timedelta(milliseconds=1)

Instant = Union[datetime, int]  # a datetime (naive means UTC) or epoch milliseconds


def to_ms(when: Instant) -> int:
    """Epoch milliseconds of a timer's time: a ``datetime`` (naive is UTC) or already milliseconds.
    A ``timedelta`` is refused: a timer is a point in time (``ctx.time + timedelta(minutes=5)``)."""
    if type(when) is int:  # (the common case, first: a timer set from ``ctx.timestamp()``)
        return when
    if isinstance(when, datetime):
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        return (when - _EPOCH) // _MS  # (exact: ``timestamp() * 1000`` in floating point can land 1 ms short)
    if isinstance(when, timedelta):
        raise DeclarationError(
            f"a timer needs a point in time, got the duration {when}; register ctx.time + {when!r} instead"
        )
    if isinstance(when, bool) or not isinstance(when, (int, float)):
        raise DeclarationError(f"a timer needs a datetime (or epoch milliseconds), got {when!r}")
    return int(when)


def to_datetime(ms: int | None) -> datetime | None:
    """The UTC ``datetime`` of epoch milliseconds (exact: the arithmetic is on integers)."""
    return None if ms is None else _EPOCH + ms * _MS


class TimerService:
    """Timers of the current key, and the clocks (Flink's ``TimerService``). Times are ``datetime``
    (UTC) or epoch milliseconds; ``current_watermark``/``current_processing_time`` give milliseconds,
    ``watermark``/``processing_time`` the same as ``datetime``."""

    def __init__(self) -> None:
        self.watermark_ms = 0
        self.processing_time_ms = 0
        self.event_timers: set[int] = set()
        self.processing_timers: set[int] = set()

    def current_watermark(self) -> int:
        return self.watermark_ms

    def current_processing_time(self) -> int:
        return self.processing_time_ms

    @property
    def watermark(self) -> datetime:
        return to_datetime(self.watermark_ms)

    @property
    def processing_time(self) -> datetime:
        return to_datetime(self.processing_time_ms)

    def register_event_time_timer(self, when: Instant) -> None:
        self.event_timers.add(to_ms(when))

    def delete_event_time_timer(self, when: Instant) -> None:
        self.event_timers.discard(to_ms(when))

    def register_processing_time_timer(self, when: Instant) -> None:
        self.processing_timers.add(to_ms(when))

    def delete_processing_time_timer(self, when: Instant) -> None:
        self.processing_timers.discard(to_ms(when))


class Context:
    """What ``process_element`` and ``on_timer`` see: the key, the time, the timers."""

    def __init__(self, timers: TimerService):
        self._timers = timers
        self.key: tuple = ()
        self.timestamp_ms: int | None = None
        self.time_domain: str = EVENT_TIME

    def get_current_key(self) -> tuple:
        return self.key

    def timestamp(self) -> int | None:
        """Event time of the element (or timestamp of the timer) being processed, ms."""
        return self.timestamp_ms

    @property
    def time(self) -> datetime | None:
        """Event time of the element (or the timer's time) being processed, as a UTC ``datetime``."""
        ms = self.timestamp_ms  # (:func:`to_datetime` inlined: a function asks for it with every row it emits)
        return None if ms is None else _EPOCH + ms * _MS

    def timer_service(self) -> TimerService:
        return self._timers


class RuntimeContext:
    """Handed to ``open``: creates state handles and records their descriptors."""

    def __init__(self, holder: StoreHolder | None = None):
        self.holder = holder or StoreHolder()
        self.descriptors: dict[str, _Descriptor] = {}

    def get_state(self, descriptor: _Descriptor):
        if not isinstance(descriptor, _Descriptor):
            raise DeclarationError(
                f"get_state expects a ValueStateDescriptor, ListStateDescriptor or MapStateDescriptor, got {descriptor!r}"
            )
        known = self.descriptors.get(descriptor.name)
        if known is not None and known != descriptor:
            raise DeclarationError(f"state {descriptor.name!r} is declared twice with different descriptors")
        self.descriptors[descriptor.name] = descriptor
        return HANDLES[descriptor.kind](descriptor, self.holder)

    # Flink's names for the same thing
    get_list_state = get_state
    get_map_state = get_state


class KeyedProcessFunction:
    """Override ``process_element``; optionally ``open`` (declare state) and ``on_timer``."""

    def open(self, ctx: RuntimeContext) -> None:  # noqa: B027 - optional hook
        pass

    def process_element(self, value: Any, ctx: Context) -> Iterable | None:
        raise NotImplementedError

    def on_timer(self, timestamp_ms: int, ctx: Context) -> Iterable | None:
        """``timestamp_ms`` is the timer's time in ms; ``ctx.time`` the same as a ``datetime``."""
        return None


def declared_state(function_class: type) -> dict[str, _Descriptor]:
    """The state a function declares in ``open`` (it is instantiated and opened on a recorder)."""
    ctx = RuntimeContext()
    function_class().open(ctx)
    return ctx.descriptors
