"""The keyed runtime in plain Python (the part Spark's binding calls once per key and batch).

Time is arranged explicitly: ``t0`` is an arbitrary epoch-millisecond origin, elements are
``(event time, id, payload)`` tuples, and each ``process`` call is one micro-batch with the
watermark Spark would hand it.
"""

from __future__ import annotations

import functools
import pickle
import random
from datetime import timedelta

import pytest

from streaming.keyed import (
    ON_READ_AND_WRITE,
    KeyedProcessFunction,
    ListStateDescriptor,
    MapStateDescriptor,
    TtlConfig,
    ValueStateDescriptor,
)
from streaming.errors import DeclarationError
from streaming.keyed.runtime import KeyedRuntime

T0 = 1_795_132_800_000  # 2026-11-20T00:00:00Z
MIN = 60_000
KEY = ("k1",)


class Recorder(KeyedProcessFunction):
    """Emits what happens, in order: ('element', t, value) and ('timer', ts, domain)."""

    def open(self, ctx):
        self.last = ctx.get_state(ValueStateDescriptor("last", "long", ttl=TtlConfig(timedelta(minutes=10))))
        self.touched = ctx.get_state(ValueStateDescriptor(
            "touched", "long", ttl=TtlConfig(timedelta(minutes=10), ON_READ_AND_WRITE)))
        self.seen = ctx.get_state(ListStateDescriptor("seen", "long", ttl=TtlConfig(timedelta(minutes=10))))
        self.by_value = ctx.get_state(MapStateDescriptor("by_value", "long"))

    def process_element(self, value, ctx):
        t = ctx.timestamp()
        yield ("element", t, value.v, self.last.value())
        self.last.update(value.v)
        self.seen.add(t)
        self.by_value.put(value.v, t)
        if value.v == "timer":
            ctx.timer_service().register_event_time_timer(t + MIN)
        if value.v == "ptimer":
            ctx.timer_service().register_processing_time_timer(ctx.timer_service().current_processing_time() + 5000)

    def on_timer(self, timestamp_ms, ctx):
        yield ("timer", timestamp_ms, ctx.time_domain, self.last.value())


def runtime(fn=Recorder, ttl=timedelta(minutes=30)):
    return KeyedRuntime(fn, ["v"], ["what", "t", "value", "last"], int(ttl / timedelta(milliseconds=1)))


def el(t, i, v):
    return (t, f"e{i}", (v,))


def test_elements_wait_for_the_watermark_and_are_delivered_in_event_time_order():
    rt = runtime()
    # batch 0, watermark -inf: nothing can be released yet
    r0 = rt.process(KEY, None, [el(T0 + 3000, 2, "b"), el(T0 + 1000, 1, "a")], 0, 0)
    assert r0.outputs == [] and r0.state is not None and r0.wakeup_ms == T0 + 1000
    # batch 1, watermark T0+2000: only 'a' (t <= W) is released; 'c' arrives out of order
    r1 = rt.process(KEY, r0.state, [el(T0 + 2500, 3, "c")], T0 + 2000, 0)
    assert [o[:3] for o in r1.outputs] == [("element", T0 + 1000, "a")]
    r2 = rt.process(KEY, r1.state, [], T0 + 10_000, 0)
    assert [o[:3] for o in r2.outputs] == [("element", T0 + 2500, "c"), ("element", T0 + 3000, "b")]


def test_an_element_behind_the_watermark_is_late_and_does_not_touch_state():
    rt = runtime()
    r = rt.process(KEY, None, [el(T0 + 1000, 1, "x"), el(T0 + 9000, 2, "y")], T0 + 5000, 0)
    assert [(t, i) for t, i, _ in r.late] == [(T0 + 1000, "e1")]
    r = rt.process(KEY, r.state, [], T0 + 20_000, 0)
    assert [o[:4] for o in r.outputs] == [("element", T0 + 9000, "y", None)]  # 'x' never became 'last'


def test_duplicate_deliveries_are_dropped_within_the_dedup_ttl_only():
    rt = runtime(ttl=timedelta(minutes=5))
    r = rt.process(KEY, None, [el(T0, 1, "a"), el(T0, 1, "a")], T0 - 1, 0)
    assert r.duplicates == 1
    r = rt.process(KEY, r.state, [el(T0, 1, "a")], T0 + MIN, 0)  # re-delivered a minute later
    assert r.duplicates == 1 and not r.late
    r = rt.process(KEY, r.state, [el(T0 + 7 * MIN, 9, "z")], T0 + 6 * MIN, 0)  # the id is forgotten after 5 min
    r = rt.process(KEY, r.state, [el(T0 + 8 * MIN, 1, "a")], T0 + 7 * MIN, 0)
    assert r.duplicates == 0


def test_an_event_time_timer_fires_after_elements_at_its_time_and_before_later_ones():
    #   timer registered for T0+60s by the element at T0:
    #   T0 ........ T0+60s (element 'at') ... timer(T0+60s) ... T0+61s (element 'after')
    rt = runtime()
    r = rt.process(KEY, None, [el(T0, 1, "timer"), el(T0 + MIN, 2, "at"), el(T0 + MIN + 1000, 3, "after")], T0 - 1, 0)
    r = rt.process(KEY, r.state, [], T0 + 2 * MIN, 0)
    assert [o[:3] for o in r.outputs] == [
        ("element", T0, "timer"), ("element", T0 + MIN, "at"), ("timer", T0 + MIN, "event_time"),
        ("element", T0 + MIN + 1000, "after"),
    ]


def test_a_timer_waits_for_the_watermark_and_wakes_the_key_up():
    rt = runtime()
    r = rt.process(KEY, None, [el(T0, 1, "timer")], T0 - 1, 0)
    r = rt.process(KEY, r.state, [], T0 + 30_000, 0)  # element released, timer (T0+60s) not due
    assert [o[0] for o in r.outputs] == ["element"] and r.wakeup_ms == T0 + MIN
    r = rt.process(KEY, r.state, [], T0 + MIN, 0)  # watermark reaches the timer: it fires
    assert [o[:3] for o in r.outputs] == [("timer", T0 + MIN, "event_time")]


class InFiveMinutes(KeyedProcessFunction):
    """Timers in datetimes and timedeltas, not milliseconds: ``ctx.time + timedelta(minutes=5)``."""

    def process_element(self, value, ctx):
        ctx.timer_service().register_event_time_timer(ctx.time + timedelta(minutes=5))
        if value.v == "twice":  # registering the same instant as epoch ms is the same timer
            ctx.timer_service().register_event_time_timer(ctx.timestamp() + 5 * MIN)
        yield ("element", ctx.time, value.v, None)

    def on_timer(self, timestamp_ms, ctx):
        yield ("timer", ctx.time, timestamp_ms, ctx.timer_service().watermark)


def test_timers_take_datetimes_and_report_the_time_as_a_datetime():
    from datetime import datetime, timezone

    rt = runtime(InFiveMinutes)
    t0 = datetime.fromtimestamp(T0 / 1000, tz=timezone.utc)
    r = rt.process(KEY, None, [el(T0, 1, "twice")], T0 - 1, 0)
    r = rt.process(KEY, r.state, [], T0 + 10 * MIN, 0)
    assert r.outputs == [("element", t0, "twice", None),
                         ("timer", t0 + timedelta(minutes=5), T0 + 5 * MIN, t0 + timedelta(minutes=10))]


def test_a_timer_given_a_duration_is_refused_with_the_fix():
    from streaming.errors import DeclarationError

    class Wrong(KeyedProcessFunction):
        def process_element(self, value, ctx):
            ctx.timer_service().register_event_time_timer(timedelta(minutes=5))

    with pytest.raises(DeclarationError, match=r"point in time.*ctx.time \+"):
        runtime(Wrong).process(KEY, None, [el(T0, 1, "x")], T0 - 1, 0, bounded=True)


def test_processing_time_timers_fire_on_the_batch_clock_and_at_end_of_input_when_bounded():
    rt = runtime()
    r = rt.process(KEY, None, [el(T0, 1, "ptimer")], T0 - 1, 100_000)
    r = rt.process(KEY, r.state, [], T0 + 1, 101_000)  # element delivered; timer set for now + 5s = 106_000
    assert r.processing_wakeup_ms == 106_000 and [o[0] for o in r.outputs] == ["element"]
    r = rt.process(KEY, r.state, [], T0 + 1, 105_999)
    assert r.outputs == []
    r = rt.process(KEY, r.state, [], T0 + 1, 106_000)
    assert [o[:3] for o in r.outputs] == [("timer", 106_000, "processing_time")]
    bounded = runtime().process(KEY, None, [el(T0, 1, "ptimer")], 0, 100_000, bounded=True)
    assert [o[:3] for o in bounded.outputs] == [("element", T0, "ptimer"), ("timer", 105_000, "processing_time")]


def test_ttl_expires_values_lists_and_refreshes_on_read_when_asked():
    class Probe(Recorder):
        def process_element(self, value, ctx):
            if value.v == "read":
                yield ("read", ctx.timestamp(), self.touched.value(), (self.last.value(), len(self.seen.get())))
            else:
                self.last.update(value.v)
                self.touched.update(value.v)
                self.seen.add(ctx.timestamp())

    rt = runtime(Probe)
    ttl = 10 * MIN
    # write at T0; reads at T0+ttl-1 and T0+2ttl-2 (each refreshes 'touched'), then one at T0+3ttl-2
    events = [el(T0, 1, "w"), el(T0 + ttl - 1, 2, "read"), el(T0 + 2 * ttl - 2, 3, "read"), el(T0 + 3 * ttl - 2, 4, "read")]
    r = rt.process(KEY, None, events, 0, 0, bounded=True)
    # at T0+ttl-1 all alive; the read refreshed 'touched' (OnReadAndWrite) but not 'last' (OnCreateAndWrite)
    assert r.outputs[0][2:] == ("w", ("w", 1))
    assert r.outputs[1][2:] == ("w", (None, 0))  # 'last' and the list expired at T0+ttl; 'touched' lives on
    assert r.outputs[2][2:] == (None, (None, 0))  # 'touched' expired exactly ttl after its last read


def test_state_is_removed_when_nothing_is_left_for_the_key():
    class Forgetful(KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(ValueStateDescriptor("v", "long", ttl=TtlConfig(timedelta(minutes=1))))

        def process_element(self, value, ctx):
            self.v.update(1)

    rt = KeyedRuntime(Forgetful, ["v"], ["x"], 30_000)
    r = rt.process(KEY, None, [el(T0, 1, 1)], T0 - 1, 0)
    r = rt.process(KEY, r.state, [], T0 + 1, 0)
    assert r.state is not None and r.wakeup_ms == T0 + MIN  # woken up when the value expires
    r = rt.process(KEY, r.state, [], T0 + MIN, 0)
    assert r.state is None and r.wakeup_ms is None


def test_rolling_spend_state_stays_bounded_over_ten_days_of_input():
    from streaming.jobs.rolling_spend import RollingSpend

    rt = KeyedRuntime(RollingSpend, ["card_id", "event_id", "event_time", "amount"],
                      ["card_id", "as_of", "spend_24h", "payments_24h", "cause"], 30 * MIN)
    rng = random.Random(7)
    state, watermark, sizes, outputs = None, T0, [], 0
    t = T0
    for batch in range(10 * 24):  # one batch per hour of event time, ~20 payments per hour
        events = []
        for i in range(rng.randint(10, 30)):
            t += rng.randint(1, 6 * MIN)
            events.append((t, f"b{batch}-{i}", ("c1", f"b{batch}-{i}", None, 10)))
        r = rt.process(("c1",), state, events, watermark, 0)  # the watermark of the batch's start
        watermark = t - 5000
        state, outputs = r.state, outputs + len(r.outputs)
        sizes.append(KeyedRuntime.state_summary(state))
    peak = max(s["list_entries"] + s["map_entries"] for s in sizes)
    assert outputs > 4000
    assert peak <= 24 * 60 // 1 + 50  # never more than a day of payments (at most one a minute here)
    assert max(s["event_timers"] for s in sizes) <= peak + 1
    assert sizes[-1]["list_entries"] + sizes[-1]["map_entries"] < 24 * 30  # it does not grow with the input
    assert max(s["remembered_ids"] for s in sizes[24:]) <= 2 * 30 * 2  # dedup ids of ~30 min only


def test_output_rows_must_fit_the_output_schema():
    class Bad(KeyedProcessFunction):
        def process_element(self, value, ctx):
            yield {"nope": 1}

    rt = KeyedRuntime(Bad, ["v"], ["x"], 1000)
    with pytest.raises(ValueError, match=r"unknown column\(s\) \['nope'\]"):
        rt.process(KEY, None, [el(T0, 1, 1)], 0, 0, bounded=True)


@pytest.mark.parametrize("columns", [["a", "b", "c"], ["x"]])
def test_dict_rows_are_taken_by_name_and_wrong_names_are_refused(columns):
    """A dict row's values go to their columns whatever the dict's order; a column it leaves out is null; a name
    that is not a column is refused by name, also when the dict has as many names as there are columns."""
    rows = [dict(zip(columns, range(len(columns)))), dict(reversed(list(zip(columns, range(len(columns))))))]
    rows.append({c: i for i, c in enumerate(columns) if i})  # the first column left out

    class Rows(KeyedProcessFunction):
        def process_element(self, value, ctx):
            yield rows[value.v]

    rt = KeyedRuntime(Rows, ["v"], columns, 1000)
    got = [rt.process(KEY, None, [el(T0, i, i)], 0, 0, bounded=True).outputs for i in range(len(rows))]
    everything = tuple(range(len(columns)))
    assert got == [[everything], [everything], [(None, *everything[1:])]]
    for wrong in ({**dict.fromkeys(columns[1:], 1), "nope": 2}, {**dict.fromkeys(columns, 1), "nope": 2}):
        rows.append(wrong)
        with pytest.raises(ValueError, match=r"unknown column\(s\) \['nope'\]"):
            rt.process(KEY, None, [el(T0, 9, len(rows) - 1)], 0, 0, bounded=True)


def test_the_time_a_function_sees_is_the_exact_utc_instant_of_its_milliseconds():
    """``ctx.time`` and the timer service's clocks as ``datetime``: checked against pandas' own conversion
    of epoch milliseconds, from before 1970 to far ahead."""
    import pandas as pd

    from streaming.keyed.function import Context, TimerService, to_datetime, to_ms

    rng = random.Random(5)
    instants = [0, -1, 1, 999, T0, T0 + 1, -62_135_596_800_000, 253_402_300_799_999,
                *[rng.randrange(-10**12, 10**13) for _ in range(2_000)]]
    ctx = Context(TimerService())
    for ms in instants:
        ctx.timestamp_ms = ms
        expected = pd.Timestamp(ms, unit="ms", tz="UTC").to_pydatetime()
        assert to_datetime(ms) == expected and ctx.time == expected and ctx.time.utcoffset() == timedelta(0)
        assert to_ms(ctx.time) == ms == to_ms(ms)
    assert to_datetime(None) is None
    with pytest.raises(DeclarationError):
        to_ms(True)


def test_remembered_ids_are_packed_and_still_catch_duplicates_whatever_the_ids_hold():
    """Remembered ids travel packed in one text; ids that hold the separator, or are empty, still work."""
    rt = runtime()
    awkward = ["plain", "with\x1fseparator", "", "ünïcode"]
    first = [(T0 + i, event_id, ("x",)) for i, event_id in enumerate(awkward)]
    r = rt.process(KEY, None, first, T0 - 1, 0)
    assert (r.inputs, r.duplicates) == (4, 0)
    again = [(T0 + 10 + i, event_id, ("y",)) for i, event_id in enumerate(reversed(awkward))]
    r = rt.process(KEY, r.state, again + [(T0 + 20, "new", ("z",))], T0, 0)
    assert (r.inputs, r.duplicates) == (5, 4)
    assert KeyedRuntime.state_summary(r.state)["remembered_ids"] == 5


@pytest.mark.parametrize("awkward", [False, True])
def test_remembered_ids_answer_as_a_plain_dict_of_ids_and_expiries(awkward):
    """A key's remembered ids (packed text, a set after many lookups, expiries cut off the front or filtered, ids
    added in a call joined when stored) against a dict: random adds, lookups, expiries and store/load cycles, ids
    in about time order with some out of order; ``awkward``: also ids that hold the separator or are not text
    (they turn the set into a plain dict)."""
    from streaming.keyed.runtime import _Seen

    only_empty = _Seen(_Seen({"seen": {"": 5}}).packed())  # (its text is empty, and holds one id)
    assert "" in only_empty and "x" not in only_empty
    only_empty.add("x", 6)
    assert "" in only_empty and "x" in only_empty and only_empty.as_dict() == {"": 5, "x": 6}
    rng = random.Random(7 + awkward)
    for _ in range(400):
        seen, oracle, clock = _Seen({}), {}, 0
        for _ in range(rng.randrange(150)):
            what, a, b = rng.choice(["add", "add", "look", "expire", "store"]), rng.randrange(61), rng.randrange(41)
            prefix = rng.choice(["", "id-", "ü", *(["\x1f"] if awkward else [])])
            event_id = a if prefix == "\x1f" and b % 7 == 0 else "" if a == 0 else f"{prefix}{a}"  # (the empty id too)
            if what == "add":
                if event_id not in oracle:
                    clock += (b % 5) * 5
                    expiry = clock + 100 - (b % 3) * 15  # mostly increasing, some earlier than the ones before
                    seen.add(event_id, expiry)
                    oracle[event_id] = expiry
            elif what == "look":
                for probe in {event_id, f"{event_id}x", f"x{event_id}", f"{event_id}"[:-1], f"{event_id}"[1:]}:
                    assert (probe in seen) == (probe in oracle), probe
            elif what == "expire":
                horizon = clock + b - 60
                seen.expire(horizon)
                oracle = {k: v for k, v in oracle.items() if v > horizon}
            else:  # stored with the key's state and loaded by its next call
                seen = _Seen(pickle.loads(pickle.dumps(seen.packed())))
                assert seen.as_dict() == oracle
            assert bool(seen) == bool(oracle)
            if oracle:
                assert seen.latest() == max(oracle.values())
        assert seen.as_dict() == oracle and all(k in seen for k in oracle)


def test_state_written_by_the_earlier_format_resumes_with_its_buffer_and_ids():
    """A format-1 state (ids as a dict, buffered rows holding decoded values) loads as it is, also in a
    runtime that decodes compact rows (the Spark binding's)."""
    import pickle
    from datetime import datetime, timezone
    from decimal import Decimal

    from streaming.spark.keyed import _decoder

    class Echo(KeyedProcessFunction):
        def process_element(self, value, ctx):
            yield (value.at, value.amount)

    at = datetime(2026, 11, 20, 0, 1, tzinfo=timezone.utc)
    old = pickle.dumps({"format": 1, "store": {"v": {}, "l": {}, "m": {}}, "et": [], "pt": [],
                        "buf": [(T0 + MIN, "old-1", (at, Decimal("12.50")))], "seen": {"old-1": T0 + 30 * MIN}})
    rt = KeyedRuntime(Echo, ["at", "amount"], ["at", "amount"], 30 * MIN, decode=_decoder(["micros", "decimal"]))
    compact = (T0 + 2 * MIN, "new-1", ((T0 + 2 * MIN) * 1000, "7.25"))
    r = rt.process(KEY, old, [(T0 + MIN, "old-1", (at, Decimal("12.50"))), compact], T0, 0)
    assert (r.duplicates, r.outputs) == (1, [])  # the id the old state remembered; both wait for the watermark
    r = rt.process(KEY, r.state, [], T0 + 3 * MIN, 0)
    assert r.outputs == [(at, Decimal("12.50")), (datetime(2026, 11, 20, 0, 2, tzinfo=timezone.utc), Decimal("7.25"))]


class Keeper(KeyedProcessFunction):
    """Stores each element's payload in value, list and map state (declared struct, timestamp and decimal
    types) and emits, on the next element, what the state gives back."""

    TYPE = "struct<amount:decimal(18,2), at:timestamp, id:string>"

    def open(self, ctx):
        self.value = ctx.get_state(ValueStateDescriptor("value", self.TYPE))
        self.history = ctx.get_state(ListStateDescriptor("history", "timestamp"))
        self.by_id = ctx.get_state(MapStateDescriptor("by_id", "decimal(18,2)"))

    def process_element(self, element, ctx):
        yield (self.value.value(), self.history.get(), self.by_id.items())
        self.value.update(element.v)
        self.history.add(element.v[1] if isinstance(element.v, tuple) else element.v)
        self.by_id.put(ctx.timestamp(), element.v[0] if isinstance(element.v, tuple) else element.v)


def test_state_of_declared_types_reads_back_exactly_what_was_written():
    """Values of a declared timestamp, decimal or struct are stored as numbers and text; what a function
    reads back is what it wrote, to the type, the decimal's exponent and the time zone, and a value that
    does not match the declared type (a naive datetime, a float, a list) is kept as it is."""
    import pickle
    from datetime import datetime, timezone
    from decimal import Decimal

    utc = datetime(2026, 11, 20, 0, 1, 2, 345678, tzinfo=timezone.utc)
    written = [
        (Decimal("12.50"), utc, "a"),
        (Decimal("-0.00"), datetime(1969, 12, 31, 23, 59, 59, 1, tzinfo=timezone.utc), None),
        (None, None, "c"),
        (Decimal("1E+3"), datetime(2026, 11, 20, 0, 1), "naive"),  # a naive datetime: kept as it is
        [Decimal("7.1"), utc, "a list"],  # not a tuple: kept as it is
        (1.5, utc, "a float"),  # not a Decimal: kept as it is
        (Decimal("3.25"), utc, "last"),
    ]
    rt = KeyedRuntime(Keeper, ["v"], ["value", "history", "by_id"], 30 * MIN)
    state, seen = None, []
    for i, v in enumerate(written):
        r = rt.process(KEY, state, [(T0 + i, f"e{i}", (v,))], T0 + i - 1, 0)
        r = rt.process(KEY, r.state, [], T0 + i, 0)
        seen.append(r.outputs[0])
        state = r.state
    for i, (value, history, by_id) in enumerate(seen[1:], start=1):
        before = written[i - 1]
        assert value == before and type(value) is type(before)
        assert [repr(f) for f in value] == [repr(f) for f in before]  # exponent, sign, tzinfo and microseconds
        expected_history = [w[1] if isinstance(w, tuple) else w for w in written[:i]]
        assert [repr(h) for h in history] == [repr(h) for h in expected_history]
        assert [repr(x) for _, x in by_id] == [repr(w[0] if isinstance(w, tuple) else w) for w in written[:i]]
    store = pickle.loads(state)["store"]
    assert "value" in store["V"] and "history" in store["l"]  # the last value compact; a list with a naive datetime as it is


def test_state_written_before_values_were_encoded_still_loads():
    """A key's state of format 2 (values pickled as Decimal and datetime objects) resumes as it is."""
    import pickle
    from datetime import datetime, timezone
    from decimal import Decimal

    at = datetime(2026, 11, 20, 0, 1, tzinfo=timezone.utc)
    old = pickle.dumps({"format": 2, "store": {"v": {"value": ((Decimal("12.50"), at, "x"), T0)}, "l": {"history": [(at, T0)]},
                                              "m": {"by_id": {T0: (Decimal("12.50"), T0)}}},
                        "et": [], "pt": [], "buf": [], "ids": "e0", "exp": b""})
    old = pickle.dumps({**pickle.loads(old), "exp": __import__("array").array("q", [T0 + 30 * MIN]).tobytes()})
    rt = KeyedRuntime(Keeper, ["v"], ["value", "history", "by_id"], 30 * MIN)
    r = rt.process(KEY, old, [(T0 + 1, "e0", (("dup",),)), (T0 + 2, "e1", ((Decimal("1.00"), at, "y"),))], T0, 0)
    assert r.duplicates == 1
    r = rt.process(KEY, r.state, [], T0 + 2, 0)
    assert r.outputs == [((Decimal("12.50"), at, "x"), [at], [(T0, Decimal("12.50"))])]


# -- property: elements and timers in time order, whatever the function registers and deletes -----------------

def _actions(kind: str, t: int, v: str) -> list[tuple[str, int]]:
    """What the scripted function does with event-time timers when called (a pure function of the call):
    registers ("+") or deletes ("-") timers around ``t`` (an element may set one in the past; a timer only
    later ones, and only early on, so every chain ends)."""
    rng = random.Random(f"{kind}/{t}/{v}")
    offsets = [-2000, -1000, 0, 0, 1000, 2500, 4000] if kind == "element" else [1000, 2500, 4000]
    if kind == "timer" and t > T0 + 30_000:
        return []
    return [("+" if rng.random() < 0.75 else "-", t + rng.choice(offsets)) for _ in range(rng.choice([0, 0, 1, 2, 3]))]


class Scripted(KeyedProcessFunction):
    def _do(self, ctx, kind, t, v):
        timers = ctx.timer_service()
        for op, ts in _actions(kind, t, v):
            (timers.register_event_time_timer if op == "+" else timers.delete_event_time_timer)(ts)

    def process_element(self, value, ctx):
        self._do(ctx, "element", ctx.timestamp(), value.v)
        yield ("element", ctx.timestamp(), value.v, None)

    def on_timer(self, timestamp_ms, ctx):
        self._do(ctx, "timer", timestamp_ms, "")
        yield ("timer", timestamp_ms, None, None)


def _expected_calls(arrivals: list[tuple[int, str, tuple]]) -> list[tuple]:
    """The oracle: each id's first delivery, in (time, id) order; a timer goes before the elements of later times
    and after those of its own; every timer fires in the end, in time order."""
    first: dict[str, tuple] = {}
    for t, i, row in arrivals:
        first.setdefault(i, (t, i, row[0]))
    elements = sorted(first.values())
    timers: set[int] = set()
    calls: list[tuple] = []

    def act(kind, t, v):
        for op, ts in _actions(kind, t, v):
            (timers.add if op == "+" else timers.discard)(ts)

    k = 0
    while k < len(elements) or timers:
        due = min(timers) if timers else None
        if due is not None and (k == len(elements) or due < elements[k][0]):
            timers.discard(due)
            calls.append(("timer", due, None))
            act("timer", due, "")
        else:
            t, _, v = elements[k]
            k += 1
            calls.append(("element", t, v))
            act("element", t, v)
    return calls


def _arrivals(rng: random.Random) -> list[tuple[int, str, tuple]]:
    """Up to 40 deliveries within 20 s (ties and re-deliveries included), in arrival order."""
    out = []
    for n in range(rng.randint(0, 40)):
        if out and rng.random() < 0.15:
            t, i, row = rng.choice(out)  # delivered again
        else:
            t, i, row = T0 + rng.randrange(0, 20_000, rng.choice([1, 500])), f"e{n}", (rng.choice("abcd"),)
        out.append((t, i, row))
    return out


@pytest.mark.parametrize("seed", range(150))
def test_elements_and_timers_reach_the_function_in_time_order_bounded_and_in_random_batches(seed):
    rng = random.Random(seed)
    arrivals = _arrivals(rng)
    want = _expected_calls(arrivals)
    rt = runtime(Scripted, ttl=timedelta(days=1))

    got = rt.process(KEY, None, list(arrivals), 0, 0, bounded=True)
    assert [o[:3] for o in got.outputs] == want
    assert got.inputs == len(arrivals) and got.duplicates == len(arrivals) - len({i for _, i, _ in arrivals})

    # The same deliveries as a stream, cut into random batches; each batch's watermark stays below the times
    # of everything delivered in it and after it (nothing is late), and a last batch lets every timer fire.
    cuts = sorted(rng.sample(range(len(arrivals) + 1), k=min(len(arrivals) + 1, rng.randint(1, 4))))
    batches = [arrivals[a:b] for a, b in zip([0, *cuts], [*cuts, len(arrivals)])]
    state, calls, watermark = None, [], T0 - 10_000
    for n, batch in enumerate(batches):
        later = [t for b in batches[n:] for t, _, _ in b]
        watermark = max(watermark, rng.randint(watermark, min(later, default=T0 + 25_000) - 1))
        r = rt.process(KEY, state, batch, watermark, 0)
        assert not r.late
        calls += [o[:3] for o in r.outputs]
        state = r.state
    r = rt.process(KEY, state, [], T0 + 3_600_000, 0)
    calls += [o[:3] for o in r.outputs]
    assert calls == want


@pytest.mark.parametrize("seed", range(3))
def test_a_key_kept_as_objects_between_calls_runs_as_one_loaded_from_its_bytes(seed):
    """A stream's worker keeps a key's state as the call left it (``Live``) instead of pickling it for the next call:
    random elements (out of order, late, re-delivered), timers of both kinds and TTL expiries through two runtimes,
    one handed its bytes each call and one its objects, with the objects' state sometimes written and read back as
    bytes (a worker that starts afresh). Every output, late element, wake-up and state must agree. A state handed to
    a call cannot be handed to another."""
    from streaming.keyed.runtime import Live, as_bytes

    rng = random.Random(seed)
    by_bytes, by_objects = runtime(), runtime()
    for _ in range(30):
        state_b = state_o = None
        watermark, now = T0, 100_000
        for _ in range(rng.randrange(1, 25)):
            events = [el(watermark + rng.randrange(-4_000, 20_000), rng.randrange(40),
                         rng.choice(["a", "b", "timer", "ptimer"])) for _ in range(rng.randrange(6))]
            rb = by_bytes.process(KEY, state_b, events, watermark, now)
            handed = state_o
            ro = by_objects.process(KEY, state_o, events, watermark, now, live=True)
            if isinstance(handed, Live):
                with pytest.raises(RuntimeError):
                    by_objects.process(KEY, handed, [], watermark, now, live=True)
            assert (ro.outputs, ro.late, ro.inputs, ro.duplicates, ro.max_event_time_ms, ro.wakeup_ms,
                    ro.processing_wakeup_ms) == (rb.outputs, rb.late, rb.inputs, rb.duplicates, rb.max_event_time_ms,
                                                 rb.wakeup_ms, rb.processing_wakeup_ms)
            assert (ro.state is None) == (rb.state is None) and (ro.stored is None) == (rb.stored is None)
            if rb.state is not None:
                assert isinstance(ro.state, Live) and pickle.loads(as_bytes(ro.state)) == pickle.loads(rb.state)
            state_b, state_o = rb.state, ro.state
            if state_o is not None and rng.random() < 0.2:
                state_o = bytes(state_o)
            watermark += rng.randrange(0, 15_000)
            now += rng.randrange(0, 4_000)


def test_a_live_states_bytes_are_pickled_once_and_stay_the_keys_state():
    """A key written whole to its file and turned into bytes at the next commit is pickled once: the bytes are kept
    with the objects. They stay the key's state while the runtime runs other keys, and a call that takes the objects
    over leaves nothing to pickle."""
    from streaming.keyed.runtime import Live

    r, by_bytes = runtime(), runtime()
    events = [el(T0 + 1_000, 1, "a"), el(T0 + 2_000, 2, "timer"), el(T0 + 500, 3, "b")]
    live = r.process(KEY, None, events, T0, 100_000, live=True).state
    expected = by_bytes.process(KEY, None, events, T0, 100_000).state
    assert isinstance(live, Live)
    first = bytes(live)
    assert bytes(live) is first and pickle.loads(first) == pickle.loads(expected)
    r.process(("k2",), None, [el(T0 + 900, 4, "a"), el(T0 + 3_000, 5, "timer")], T0 + 1_500, 100_500, live=True)
    assert pickle.loads(bytes(live)) == live.saved() == pickle.loads(expected)
    later = [el(T0 + 4_000, 6, "a")]
    after = r.process(KEY, live, later, T0 + 2_500, 101_000, live=True).state
    with pytest.raises(RuntimeError):
        bytes(live)
    assert pickle.loads(bytes(after)) == pickle.loads(by_bytes.process(KEY, expected, later, T0 + 2_500, 101_000).state)


def test_a_stream_call_over_few_keys_keeps_their_states_as_objects_and_one_over_many_as_bytes(tmp_path, monkeypatch):
    """A call of a stream's bucket keeps the states of the keys it ran as objects for their next call only when it ran
    at most ``LIVE_KEYS_MAX`` keys (a backlog or a burst of new keys leaves bytes, which the worker's collection after
    each task does not walk); either way the next call runs on them."""
    import pandas as pd
    from pyspark.sql import types as T

    from streaming.jobs.large_amount_alerts import JOB
    from streaming.keyed import files as keys
    from streaming.keyed.runtime import Live
    from streaming.spark import keyed as K

    payload = T.StructType([T.StructField(n, t) for n, t in [
        ("card_id", T.StringType()), ("user_id", T.StringType()), ("event_id", T.StringType()),
        ("event_time", T.TimestampType()), ("amount", T.DecimalType(18, 2))]])
    main = T.StructType([T.StructField(n, t) for n, t in [
        ("card_id", T.StringType()), ("user_id", T.StringType()), ("event_id", T.StringType()),
        ("event_time", T.TimestampType()), ("amount", T.DecimalType(18, 2)), ("previous_amount", T.DecimalType(18, 2)),
        ("previous_time", T.TimestampType()), ("previous_event_id", T.StringType()), ("ratio", T.DoubleType())]])
    adapter = K._Adapter(JOB, payload, main, K._output_schema(JOB, main, payload))
    monkeypatch.setattr(K, "LIVE_KEYS_MAX", 3)

    def payments(cards: int, first: int) -> pd.DataFrame:
        return pd.DataFrame([{"_bucket": 0, "_f": "file:/x/a.jsonl", "_e": "{}", "_p_card_id": f"c{c}",
                              "_p_user_id": f"u{c}", "_p_event_id": f"e{first + c}",
                              "_p_event_time": (T0 + 1_000 * (first + c)) * 1000, "_p_amount": "12.50", "_bad": None}
                             for c in range(cards)])

    for cards, kept in ((3, True), (4, False)):
        root = str(tmp_path / f"keys-{cards}")
        files: list[str] = []
        for call, watermark in enumerate((T0, T0 + 60_000)):
            view = keys.view(root, 0, files, {}, merge=functools.partial(KeyedRuntime.merged, live=True))
            adapter.process_bucket(payments(cards, 100 * call), view, watermark, 0,
                                   commit=lambda changed, view=view: keys.commit(root, 0, view, changed, {}))
            files = list(view.files)
            states = [row[0] for row in view.rows.values()]
            assert len(states) == cards and all(isinstance(s, Live) == kept for s in states), (cards, call)
        # the first call's elements were delivered by the second (the watermark passed them), as they are from bytes
        keys.forget(root)
        again = keys.view(root, 0, files, {}, merge=functools.partial(KeyedRuntime.merged, live=True))
        assert {k: KeyedRuntime.state_summary(r[0]) for k, r in again.rows.items()} == \
            {k: KeyedRuntime.state_summary(s) for k, s in zip(view.rows, states)}


class _Arrivals(KeyedProcessFunction):
    """Emits every element it is handed, with how many came before it for the key."""

    def open(self, ctx):
        self.n = ctx.get_state(ValueStateDescriptor("n", "long"))

    def process_element(self, value, ctx):
        n = self.n.value() or 0
        self.n.update(n + 1)
        yield {"card_id": value.card_id, "event_time": value.event_time, "event_id": value.event_id,
               "amount": value.amount, "n": n}


@pytest.mark.parametrize("seed", range(40))
def test_a_bounded_bucket_hands_each_key_its_first_deliveries_in_time_and_id_order(seed, monkeypatch):
    """The bounded twin's bucket call groups, deduplicates and orders a bucket's events a column at a time
    (``_Adapter.bounded_by_key``); random buckets (several keys, a NULL key, ties in time, ids delivered again with
    another time or to another key) against the oracle: per key, each id's first delivery in arrival order, then in
    (time, id) order; and the counts of the call. The element-wise path (several key columns take it) gives the same."""
    import json

    import pandas as pd
    from pyspark.sql import types as T

    from streaming.declaration import KeyedJob, Table, Watermark
    from streaming.jobs.sources import PAYMENTS
    from streaming.spark import keyed as K

    job = KeyedJob(name="arrivals_test", sources=(PAYMENTS,), keys=("card_id",), watermark=Watermark(timedelta(0)),
                   transform=lambda f: f, function=_Arrivals, time_column="event_time", sink=Table("lake.test.arrivals"),
                   output="card_id string, event_time timestamp, event_id string, amount decimal(18,2), n long",
                   history=timedelta(hours=1))
    payload = T.StructType([T.StructField(n, t) for n, t in [
        ("card_id", T.StringType()), ("event_id", T.StringType()), ("event_time", T.TimestampType()),
        ("amount", T.DecimalType(18, 2))]])
    main = T.StructType([T.StructField(n, t) for n, t in [
        ("card_id", T.StringType()), ("event_time", T.TimestampType()), ("event_id", T.StringType()),
        ("amount", T.DecimalType(18, 2)), ("n", T.LongType())]])
    rng = random.Random(seed)
    arrivals = []  # (card, t ms, id, amount) in arrival order
    for i in range(rng.randint(1, 300)):
        if arrivals and rng.random() < 0.1:
            card, t, event_id, _ = rng.choice(arrivals)  # delivered again: another time, amount or card at times
            if rng.random() < 0.3:
                t += rng.choice([-2_000, 3_000])
            if rng.random() < 0.2:
                card = rng.choice(["c1", "c2", None])
        else:
            card, t, event_id = rng.choice(["c1", "c2", "c3", None]), T0 + rng.randrange(0, 10_000, rng.choice([1, 1_000])), \
                f"e{rng.randrange(10 ** 6)}"
        arrivals.append((card, t, event_id, f"{rng.randrange(1, 10 ** 5) / 100:.2f}"))
    pdf = pd.DataFrame({"_bucket": 0, "_p_card_id": [a[0] for a in arrivals], "_p_event_id": [a[2] for a in arrivals],
                        "_p_event_time": [a[1] * 1000 for a in arrivals], "_p_amount": [a[3] for a in arrivals],
                        "_bad": None})

    want: dict = {}
    for card, t, event_id, amount in arrivals:
        want.setdefault(card, {}).setdefault(event_id, (t, event_id, amount))
    want = {card: [(t, i, a, n) for n, (t, i, a) in enumerate(sorted(first.values()))] for card, first in want.items()}

    def run():
        adapter = K._Adapter(job, payload, main, K._output_schema(job, main, payload))
        out = adapter.process_bucket(pdf, None, 0, 0, bounded=True)
        got: dict = {}
        for row in out[out["_kind"] == "out"].itertuples(index=False):
            card = None if pd.isna(row._1) else row._1
            assert (None if pd.isna(row._2) else row._2) == card
            got.setdefault(card, []).append((int(pd.Timestamp(row._3).value // 1_000_000), row._4, f"{row._5:.2f}", row._6))
        stats = json.loads(out[out["_kind"] == "stats"]["_x"].iloc[0])
        return got, stats

    counts = {"_s_in": len(arrivals), "_s_dup": len(arrivals) - sum(map(len, want.values())),
              "_s_max_t": max(a[1] for a in arrivals)}
    fast, stats = run()
    assert fast == want
    assert {k: stats[k] for k in counts} == counts
    monkeypatch.setattr(K._Adapter, "bounded_by_key", lambda self, pdf: None)
    slow, stats = run()
    assert slow == want
    assert {k: stats[k] for k in counts} == counts
