"""The per-key runtime of a :class:`KeyedProcessFunction`, in plain Python (no Spark).

One call of :meth:`KeyedRuntime.process` handles one key in one micro-batch (or, bounded, the
key's whole input): it restores the key's state from bytes, drops duplicate deliveries, sends
late elements aside, buffers the rest, then delivers every buffered element and fires every
timer the watermark has passed, in event-time order (see ``function`` for the rules). It
returns the outputs, the late elements, the new state bytes (None: nothing left for the key)
and when the key must be woken up again (the earliest buffered element, timer or TTL expiry).
The Spark binding maps that wake-up onto Spark's group-state timeout.
"""

from __future__ import annotations

import heapq
import operator
import pickle
from array import array
from collections import namedtuple
from itertools import compress
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ..time import NEG_INF_MS, POS_INF_MS
from .files import as_bytes
from .function import EVENT_TIME, PROCESSING_TIME, Context, Instant, RuntimeContext, TimerService, to_ms
from .state import KeyStore, StoreHolder, codec

STATE_FORMAT = 3  # 2: remembered ids packed (``_Seen``); 3: values of declared types encoded (``state.codec``); older formats load as they are
_ID_SEP = "\x1f"
_TIME_AND_ID = operator.itemgetter(0, 1)  # an element's order: (event time, dedup key)


class _Seen:
    """A key's remembered ids (dedup keys) with their expiries, kept as they are stored: one text of the
    ids joined by a separator and one array of expiries. Most calls look up and add a few ids; unpacking
    the ids into a dict and packing them again was 9 % of the Python workers' time in a keyed latency run.
    Ids that are not text, or hold the separator, turn the set into a plain dict (stored as such).

    A key remembers every id of the last ``dedup_ttl`` (a card paying every ~0.3 s: ~6,000 in 30 minutes), and a
    call usually looks up a handful: a lookup scans the text (~20 us in 6,000 ids) until a call has made
    :attr:`_INDEX_AFTER` of them, and only then builds a set (~0.4 ms); ids added in a call are joined to the text
    once, when it is stored; the expiries are compared as one array (a Python ``min`` over 6,000 took 0.13 ms), and
    the ids that expire are cut off the front of the text when they are its oldest, as they are when ids arrive in
    about time order."""

    __slots__ = ("text", "exp", "plain", "_index", "_new", "_scans", "added", "added_exp", "incremental")
    _INDEX_AFTER = 16  # lookups in the packed text in one call before they go through a set of its ids

    def __init__(self, saved: dict):
        self.plain: dict | None = None
        self._index: set | None = None
        self._new: list[str] = []  # ids added since ``text`` was joined (their expiries are in ``exp`` already)
        self._scans = 0
        self.added: list = []  # the ids added since loading, in order, and their expiries (see ``KeyResult.stored``)
        self.added_exp: list[int] = []
        # Whether the ids after a call are those before it, expired, then the call's own: they were packed, or none
        self.incremental = "ids" in saved or not saved.get("seen")
        self._load(saved)

    def _load(self, saved: dict) -> None:
        self.exp = array("q")
        self.text = ""
        self._index = None
        self._new = []
        if "ids" in saved:
            self.text = saved["ids"]
            self.exp.frombytes(saved["exp"])
        elif saved.get("seen"):  # format 1 (or ids that could not be packed)
            self.plain = dict(saved["seen"])

    def begin(self) -> None:
        """Start a call on ids a call before it left (a key's :class:`Live` state): what the call adds is its own, and
        ids kept as a dict are packed if they can be, as storing and loading them would."""
        if self.plain is not None:
            packed = self.packed()
            if "ids" in packed:
                self.plain = None
                self._load(packed)
        self._scans = 0
        self.added, self.added_exp = [], []
        self.incremental = self.plain is None or not self.plain

    def __bool__(self) -> bool:
        return bool(self.plain) if self.plain is not None else len(self.exp) > 0

    def __contains__(self, event_id) -> bool:
        if self.plain is not None:
            return event_id in self.plain
        if not self.exp or type(event_id) is not str or _ID_SEP in event_id:
            return False  # (a packed text never holds an id with the separator)
        if self._index is not None:
            return event_id in self._index
        if event_id in self._new:
            return True
        self._scans += 1
        if self._scans > self._INDEX_AFTER:
            self._index = set(self._joined().split(_ID_SEP))
            return event_id in self._index
        if len(self.exp) == len(self._new):  # (no id in the text)
            return False
        text, n = self.text, len(event_id)
        if text.startswith(event_id) and (len(text) == n or text[n] == _ID_SEP):
            return True
        if len(text) > n and text.endswith(event_id) and text[-n - 1] == _ID_SEP:
            return True
        return f"{_ID_SEP}{event_id}{_ID_SEP}" in text

    def add(self, event_id, expiry: int) -> None:
        self.added.append(event_id)
        self.added_exp.append(expiry)
        if self.plain is None and (type(event_id) is not str or _ID_SEP in event_id):
            self.plain = self.as_dict()
        if self.plain is not None:
            self.plain[event_id] = expiry
            return
        self._new.append(event_id)
        self.exp.append(expiry)
        if self._index is not None:
            self._index.add(event_id)

    def _joined(self) -> str:
        """The text of every id, the ones added since it was last joined included."""
        if self._new:
            before = len(self.exp) - len(self._new)  # ids in the text
            self.text = _ID_SEP.join([self.text, *self._new] if before else self._new)
            self._new = []
        return self.text

    def _expiries(self) -> np.ndarray:
        """The expiries as an array over the same memory: let it go before ``exp`` changes size."""
        return np.frombuffer(self.exp, dtype=np.int64)

    def as_dict(self) -> dict:
        if self.plain is not None:
            return self.plain
        if not self.exp:
            return {}
        return dict(zip(self._joined().split(_ID_SEP), self.exp))

    def latest(self) -> int:
        return max(self.plain.values()) if self.plain is not None else int(self._expiries().max())

    def expire(self, horizon: int) -> None:
        """Forget the ids whose expiry the key's clock has reached."""
        if not self:
            return
        if self.plain is not None:
            if min(self.plain.values()) <= horizon:
                self.plain = {k: v for k, v in self.plain.items() if v > horizon}
            return
        due = self._expiries() <= horizon
        n = int(np.count_nonzero(due))
        if not n:
            return
        text = self._joined()
        self._index = None
        if n == len(due):
            self.text, self.exp = "", array("q")
        elif not due[n:].any():  # the ids that expire are the n oldest
            self.text = text.split(_ID_SEP, n)[n]
            del self.exp[:n]
        else:
            keep = ~due
            kept = self._expiries()[keep]  # (a copy)
            self.text = _ID_SEP.join(compress(text.split(_ID_SEP), keep))
            self.exp = array("q", kept.tobytes())

    def packed(self) -> dict:
        if self.plain is None:
            return {"ids": self._joined(), "exp": self.exp.tobytes()}
        try:  # (ids of an older state, now perhaps all packable)
            ids = _ID_SEP.join(self.plain)
        except TypeError:  # an id that is not text
            return {"seen": self.plain}
        if self.plain and ids.count(_ID_SEP) != len(self.plain) - 1:  # an id that holds the separator
            return {"seen": self.plain}
        return {"ids": ids, "exp": array("q", self.plain.values()).tobytes()}


class Live:
    """A key's state as a call left it, as objects: a stream's worker keeps it for the key's next call, which takes it
    as it is instead of unpickling the key's bytes (and the call after it pickles nothing it does not write). A call
    takes it over (:meth:`take`) and changes it in place, so a state is handed to one call only: a caller that may
    have to run a key again from the same state (a failed call's replay) keeps the bytes (``bytes(state)``)."""

    __slots__ = ("store", "et", "pt", "buf", "seen", "_bytes")

    def __init__(self, store, et, pt, buf: list, seen: "_Seen"):
        self.store = store  # a KeyStore, or its dump (a state merged from a key file, decoded when a call takes it)
        self.et, self.pt, self.buf, self.seen = et, pt, buf, seen
        self._bytes: bytes | None = None  # its pickle, once made (nothing changes it until a call takes it)

    def take(self) -> tuple:
        if self.seen is None:
            raise RuntimeError("this key state was handed to a call already; pass its bytes to run the key again")
        parts = (self.store, self.et, self.pt, self.buf, self.seen)
        self.store = self.et = self.pt = self.buf = self.seen = self._bytes = None
        return parts

    def saved(self) -> dict:
        if self.seen is None:
            raise RuntimeError("this key state was handed to a call already")
        store = self.store.dump() if isinstance(self.store, KeyStore) else self.store
        return {"format": STATE_FORMAT, "store": store, "et": sorted(self.et), "pt": sorted(self.pt), "buf": self.buf,
                **self.seen.packed()}

    def __bytes__(self) -> bytes:
        """The state's bytes, pickled once: a key written whole to its file and turned into bytes at the next commit
        (the call after it did not run it) is not pickled twice."""
        if self._bytes is None:
            self._bytes = pickle.dumps(self.saved(), protocol=pickle.HIGHEST_PROTOCOL)
        return self._bytes


class _Timers(TimerService):
    """Timer sets with heaps for ordered firing (registration may happen while firing)."""

    def __init__(self) -> None:
        super().__init__()
        self._event_heap: list[int] = []

    def load(self, event: Iterable[int], processing: Iterable[int]) -> None:
        self.event_timers = set(event)
        self.processing_timers = set(processing)
        self._event_heap = sorted(self.event_timers)

    def register_event_time_timer(self, when: Instant) -> None:
        ts = to_ms(when)
        if ts not in self.event_timers:
            self.event_timers.add(ts)
            heapq.heappush(self._event_heap, ts)

    def next_event_timer(self) -> int | None:
        heap = self._event_heap
        while heap and heap[0] not in self.event_timers:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def pop_event_timer(self) -> int:
        ts = heapq.heappop(self._event_heap)
        self.event_timers.discard(ts)
        return ts


@dataclass
class KeyResult:
    outputs: list[tuple] = field(default_factory=list)
    late: list[tuple[int, str, tuple]] = field(default_factory=list)  # (event time ms, dedup key, row)
    inputs: int = 0
    duplicates: int = 0
    max_event_time_ms: int | None = None
    state: "bytes | Live | None" = None  # (a :class:`Live` state when the call was asked for one)
    # What a stream's key files keep of ``state`` (``keyed.files``): the state without its remembered ids and buffered
    # elements, and what the call added to them with the horizon it forgot older ids at and the watermark it delivered
    # elements up to (see :meth:`KeyedRuntime.merged`); None: ``state`` whole
    stored: tuple[bytes, bytes] | None = None
    wakeup_ms: int | None = None  # event time at which the key needs the watermark to have arrived
    processing_wakeup_ms: int | None = None


class KeyedRuntime:
    """Runs one function instance over the keys of one worker, one key at a time."""

    def __init__(self, function_class: type, payload_columns: Sequence[str], output_columns: Sequence[str],
                 dedup_ttl_ms: int, decode: Callable[[tuple], Sequence] | None = None):
        """``decode``: turns a payload row as it was handed in (and buffered) into the values the function
        sees; a binding that buffers compact rows (timestamps as numbers) decodes each one once, on delivery."""
        self.holder = StoreHolder()
        runtime_ctx = RuntimeContext(self.holder)
        self.function = function_class()
        self.function.open(runtime_ctx)
        self.descriptors = runtime_ctx.descriptors
        self.codecs = {name: c for name, d in self.descriptors.items() if (c := codec(d.type)) is not None}
        self.timers = _Timers()
        self.ctx = Context(self.timers)
        self.Event = namedtuple("Event", payload_columns, rename=True)
        self.output_columns = list(output_columns)
        self._names = frozenset(self.output_columns)
        self._width = len(self.output_columns)
        # A dict naming every output column (the common row) is read in one call.
        self._pick = operator.itemgetter(*self.output_columns) if self._width > 1 else None
        self.dedup_ttl_ms = dedup_ttl_ms
        self.decode = decode

    # -- one key -------------------------------------------------------------------------
    def process(self, key: tuple, state: "bytes | Live | None", events: Iterable[tuple[int, str, tuple]],
                watermark_ms: int, processing_time_ms: int, *, bounded: bool = False,
                decoded: bool = False, live: bool = False, unique_sorted: bool = False) -> KeyResult:
        """``events``: (event time ms, dedup key, payload row) in arrival order; ``decoded``: their rows hold
        the values the function sees already (a binding that delivers every element in the same call, as a
        bounded run does, decodes whole columns at once), and ``state`` buffers none. ``state``: the key's bytes, or
        a :class:`Live` state, which the call takes over; ``live``: the result's state is one (else bytes).

        Stream: ``watermark_ms`` is the batch's watermark. Bounded: every element is on time and
        at the end every timer fires (``watermark_ms`` is ignored). ``unique_sorted`` (bounded, no state): ``events`` is a
        list of each id once, in (event time, id) order (the binding deduplicated and sorted them as this would); the
        list becomes the key's buffer, and the result counts no duplicates.
        """
        if isinstance(state, Live):
            store, event_timers, processing_timers, buffer, seen = state.take()
            if not isinstance(store, KeyStore):
                store = KeyStore(store, self.codecs)
            seen.begin()
        else:
            saved = pickle.loads(state) if state else {}
            store = KeyStore(saved.get("store"), self.codecs)
            event_timers, processing_timers = saved.get("et", ()), saved.get("pt", ())
            buffer = saved.get("buf", [])
            seen = _Seen(saved)
        self.holder.store = store
        self.timers.load(event_timers, processing_timers)
        waiting = len(buffer)  # (the elements buffered before the call: the call's own come after them)
        result = KeyResult()
        self.ctx.key = key
        self.timers.processing_time_ms = processing_time_ms
        self.timers.watermark_ms = NEG_INF_MS if bounded else watermark_ms
        limit = POS_INF_MS if bounded else watermark_ms

        inputs = duplicates = 0
        max_t = None
        arrived = False
        if unique_sorted and bounded and not seen:
            buffer = events  # (the call's own list: delivered and emptied below)
            inputs = len(buffer)
            max_t = buffer[-1][0] if buffer else None  # (``arrived`` stays False: nothing to sort)
        elif bounded and not seen:
            # A bounded run hands a key all its elements at once and keeps no state after it, so its ids are a
            # plain set: nothing is late, nothing is forgotten before the end (see ``_finish``).
            ids: set = set()
            for element in events:
                t, event_id = element[0], element[1]
                inputs += 1
                if max_t is None or t > max_t:
                    max_t = t
                if event_id in ids:
                    duplicates += 1
                    continue
                ids.add(event_id)
                buffer.append(element)
            arrived = bool(ids)
        else:
            ttl = self.dedup_ttl_ms
            for t, event_id, row in events:
                inputs += 1
                if max_t is None or t > max_t:
                    max_t = t
                if event_id in seen:
                    duplicates += 1
                    continue
                seen.add(event_id, (t if bounded or t > watermark_ms else watermark_ms) + ttl)
                if not bounded and t <= watermark_ms:
                    result.late.append((t, event_id, row))
                    continue
                buffer.append((t, event_id, row))
                arrived = True
        result.inputs, result.duplicates, result.max_event_time_ms = inputs, duplicates, max_t
        buffered = [] if bounded or not arrived else buffer[waiting:]
        if arrived:
            buffer.sort(key=_TIME_AND_ID)

        clock = self._advance(buffer, limit, result.outputs, None if decoded else self.decode)
        # The key's event-time clock from here on: the watermark (every element up to it has been
        # delivered) or, bounded, the last element or timer.
        horizon = clock if bounded else watermark_ms
        if bounded:
            self.timers.watermark_ms = POS_INF_MS
            for ts in sorted(self.timers.processing_timers):  # end of input: pending processing-time timers fire once
                self._fire(ts, horizon, result.outputs)
            self.timers.processing_timers.clear()
        else:
            while self.timers.processing_timers and min(self.timers.processing_timers) <= processing_time_ms:
                self._fire(min(self.timers.processing_timers), horizon, result.outputs)

        store.expire(self.descriptors, horizon)
        seen.expire(horizon)
        self._finish(result, store, buffer, seen, bounded, horizon, buffered, limit, live)
        return result

    def _advance(self, buffer: list, limit: int, outputs: list, decode: Callable[[tuple], Sequence] | None) -> int:
        """Deliver buffered elements and fire event-time timers up to ``limit``, in time order (a timer before
        the elements of later times, after those of its own). Returns the event-time clock reached (the last
        element or timer time)."""
        clock = NEG_INF_MS
        timers, ctx, store = self.timers, self.ctx, self.holder.store
        heap = timers._event_heap  # noqa: SLF001 - (a look at its head: most elements have no timer before them)
        process_element, make, row_of, append = self.function.process_element, self.Event, self._row, outputs.append
        i, n = 0, len(buffer)
        while i < n:
            t, _, row = buffer[i]
            if t > limit:
                break
            if heap and heap[0] < t:
                timer = timers.next_event_timer()  # (drops timers deleted since they were set)
                if timer is not None and timer < t:
                    clock = self._timer(timers.pop_event_timer(), clock, outputs)
                    continue
            i += 1
            if t > clock:
                clock = t
            ctx.timestamp_ms = t
            ctx.time_domain = EVENT_TIME
            store.now_ms = t
            produced = process_element(make(*(decode(row) if decode else row)), ctx)
            if produced is not None:
                for value in produced:
                    append(row_of(value))
        del buffer[:i]
        while True:  # the timers up to the limit that no element up to it comes before
            timer = timers.next_event_timer()
            if timer is None or timer > limit:
                return clock
            clock = self._timer(timers.pop_event_timer(), clock, outputs)

    def _timer(self, ts: int, clock: int, outputs: list) -> int:
        self._call(self.function.on_timer(ts, self._at(ts, EVENT_TIME)), outputs)
        return ts if ts > clock else clock

    def _fire(self, ts: int, clock: int, outputs: list) -> None:
        """Fire processing-time timer ``ts``; state TTL still follows the event-time ``clock``."""
        self.timers.processing_timers.discard(ts)
        self._at(ts, PROCESSING_TIME)
        self.holder.store.now_ms = clock
        self._call(self.function.on_timer(ts, self.ctx), outputs)

    def _at(self, ts: int, domain: str) -> Context:
        self.ctx.timestamp_ms = ts
        self.ctx.time_domain = domain
        self.holder.store.now_ms = ts
        return self.ctx

    def _call(self, produced: Any, outputs: list) -> None:
        if produced is None:
            return
        for row in produced:
            outputs.append(self._row(row))

    def _row(self, row: Any) -> tuple:
        pick = self._pick
        if pick is not None and type(row) is dict and len(row) == self._width:
            try:
                return pick(row)
            except KeyError:  # (as many names, not the same ones: the full check below names them)
                pass
        if isinstance(row, dict):
            if not self._names.issuperset(row):
                unknown = set(row) - self._names
                raise ValueError(f"output row has unknown column(s) {sorted(unknown)}; the output schema is {self.output_columns}")
            return tuple(map(row.get, self.output_columns))
        values = tuple(row)
        if len(values) != self._width:
            raise ValueError(f"output row {values!r} has {len(values)} values; the output schema has {self.output_columns}")
        return values

    def _finish(self, result: KeyResult, store: KeyStore, buffer: list, seen: _Seen, bounded: bool, horizon: int,
                buffered: list, limit: int, live: bool) -> None:
        if bounded:
            return
        pending = [buffer[0][0]] if buffer else []
        timer = self.timers.next_event_timer()
        if timer is not None:
            pending.append(timer)
        expiry = store.next_expiry_ms(self.descriptors)
        if expiry is not None:
            pending.append(expiry)
        if not pending and seen:
            pending.append(seen.latest())  # only remembered ids are left: wake up to forget the key
        result.wakeup_ms = min(pending) if pending else None
        result.processing_wakeup_ms = min(self.timers.processing_timers) if self.timers.processing_timers else None
        if store.is_empty() and not buffer and not seen and not self.timers.event_timers and not self.timers.processing_timers:
            result.state = None
            return
        core = {"format": STATE_FORMAT, "store": store.dump(), "et": sorted(self.timers.event_timers),
                "pt": sorted(self.timers.processing_timers)}
        # Kept in part only when the call added less than half the key's ids (a key's first call, or a backlog, writes
        # it whole: pickling its buffer and ids twice cost a first batch of 1,000 events per key ~45 % more in here).
        # (The ids a call adds never expire in it: their expiry is past the horizon.) The part leaves out the buffered
        # elements too: a key waits for the watermark with seconds of them, and a call adds a few.
        if seen.incremental and seen.plain is None and 2 * len(seen.added) < len(seen.exp):
            result.stored = (pickle.dumps(core, protocol=pickle.HIGHEST_PROTOCOL),
                             pickle.dumps((seen.added, seen.added_exp, horizon, buffered, limit),
                                          protocol=pickle.HIGHEST_PROTOCOL))
        if live:
            # (the timers' sets are this call's own: the next call's ``load`` makes new ones)
            result.state = Live(store, self.timers.event_timers, self.timers.processing_timers, buffer, seen)
        else:
            result.state = pickle.dumps({**core, "buf": buffer, **seen.packed()}, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def merged(before: "bytes | Live | None", core: bytes, added: bytes, live: bool = False) -> "bytes | Live":
        """A key's state after a call, from its state before the call and what the call stored (``KeyResult.stored``):
        the ids before it, those at or behind the horizon forgotten, then the ones it added; the elements buffered
        before it and those it buffered, less those it delivered (up to its watermark, in the order the call sorted
        them). A key remembers the ids of the last ``dedup_ttl`` (thousands, for a key with an event a second) and
        buffers seconds of elements: its key files keep each id and element once instead of in every batch that
        touches the key. ``before``: bytes, or a :class:`Live` state, which this takes over; ``live``: return one."""
        saved = pickle.loads(core)
        ids, expiries, horizon, *buffered = pickle.loads(added)
        if isinstance(before, Live):
            _, _, _, waiting, seen = before.take()  # (its store and timers are the core's now)
        else:
            earlier = pickle.loads(before) if before else {}
            seen, waiting = _Seen(earlier), earlier.get("buf", [])
        seen.expire(horizon)
        for event_id, expiry in zip(ids, expiries):
            seen.add(event_id, expiry)
        if buffered:  # (a part written before buffered elements were left out holds its buffer)
            arrived, limit = buffered
            buffer = waiting + arrived
            buffer.sort(key=_TIME_AND_ID)
            delivered = 0
            while delivered < len(buffer) and buffer[delivered][0] <= limit:
                delivered += 1
            del buffer[:delivered]
        else:
            buffer = saved.get("buf", [])
        if live:
            return Live(saved.get("store"), saved.get("et", ()), saved.get("pt", ()), buffer, seen)
        saved["buf"] = buffer
        saved.update(seen.packed())
        return pickle.dumps(saved, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def state_summary(state: "bytes | Live | None") -> dict:
        """Sizes of a key's state (tests, inspection): entries per kind, timers, buffer, ids."""
        if not state:
            return {}
        state = as_bytes(state)
        saved = pickle.loads(state)
        store = saved["store"]
        return {
            "values": len(store["v"]) + len(store.get("V", ())),
            "list_entries": sum(len(v) for part in ("l", "L") for v in store.get(part, {}).values()),
            "map_entries": sum(len(v) for part in ("m", "M") for v in store.get(part, {}).values()),
            "event_timers": len(saved["et"]),
            "processing_timers": len(saved["pt"]),
            "buffered": len(saved["buf"]),
            "remembered_ids": len(_Seen(saved).as_dict()),
            "bytes": len(state),
        }
