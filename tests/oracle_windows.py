"""Independent oracle for windowed jobs: plain Python, Flink's rules, replayed batch by batch.

Written from the semantics in the issue (not from streaming/windowed/batch.py):

* windows are ``[start, end)``; tumbling ``[k*size, ...)``, sliding ``[k*every, k*every + size)``,
  sessions ``[first, last + gap)`` where windows of a key that overlap or touch merge;
* the watermark after a batch is ``max(previous, max event time so far - delay)``, -inf at first;
* an (event, window) is late when ``window end + lateness <= watermark at the batch start``
  (sessions: the event's own window ``[t, t + gap)``); late rows are kept aside, per window;
* a window fires once the watermark reaches its end, and is corrected while
  ``end + lateness > watermark``; after that it is gone, and a later on-time event for the same
  time starts a new session (Flink purges the window state);
* ``having`` keeps only the windows that satisfy it; the table holds each window's latest row.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Win:
    kind: str  # tumbling | sliding | session
    size: int = 0
    every: int = 0
    gap: int = 0

    def assign(self, t: int) -> list[tuple[int, int]]:
        if self.kind == "session":
            return [(t, t + self.gap)]
        every = self.every or self.size
        last = t - t % every
        out = []
        start = last
        while start + self.size > t:
            out.append((start, start + self.size))
            start -= every
        return out


def win_of(window) -> Win:
    """The oracle's window for a job's declared one (read for its kind and sizes only)."""
    kind = type(window).__name__.lower()
    if kind == "session":
        return Win("session", gap=window.gap_ms)
    if kind == "sliding":
        return Win("sliding", size=window.size_ms, every=window.every_ms)
    return Win("tumbling", size=window.size_ms)


@dataclass
class WindowTruth:
    table: dict[tuple, dict] = field(default_factory=dict)  # (key, window_start) -> row (what the sink holds)
    late: list[tuple[str, str, int, int]] = field(default_factory=list)  # (event id, key, window start, window end)
    watermark: float = NEG_INF
    writes: int = 0
    deletes: int = 0


def replay_windows(
    batches: list[list[dict]],
    win: Win,
    *,
    delay: int,
    lateness: int,
    key: Callable[[dict], str],
    measure: Callable[[list[dict]], dict],
    having: Callable[[dict], bool] = lambda row: True,
    keep: Callable[[dict], bool] = lambda e: True,
) -> WindowTruth:
    """``batches``: per micro-batch, the valid events (dicts with ``event_id`` and ``t_ms``) in
    arrival order; duplicates are removed here by ``event_id``. Every valid event moves the
    watermark; only those ``keep`` accepts (the job's transform) are windowed."""
    truth = WindowTruth()
    seen: set[str] = set()
    # open windows: key -> list of [start, end, events, fired]
    open_windows: dict[str, list[list]] = defaultdict(list)
    watermark = NEG_INF
    for events in batches:
        batch_max = None
        for e in events:
            batch_max = e["t_ms"] if batch_max is None else max(batch_max, e["t_ms"])
            if e["event_id"] in seen:
                continue
            seen.add(e["event_id"])
            if not keep(e):
                continue
            k = key(e)
            for start, end in win.assign(e["t_ms"]):
                if end + lateness <= watermark:
                    truth.late.append((e["event_id"], k, start, end))
                    continue
                _add(open_windows[k], win, start, end, e)
        if batch_max is not None:
            watermark = max(watermark, batch_max - delay)
        for k, windows in open_windows.items():
            for w in windows:
                start, end, evs, state = w
                if end <= watermark and state["changed"]:
                    row = measure(evs)
                    for old in state["in_sink"]:
                        if old != start or not having(row):
                            truth.table.pop((k, old), None)
                            truth.deletes += 1
                    state["in_sink"] = set()
                    if having(row):
                        truth.table[(k, start)] = {"window_end": end, **row}
                        state["in_sink"] = {start}
                        truth.writes += 1
                    state["changed"] = False
            open_windows[k] = [w for w in windows if w[1] + lateness > watermark]
    truth.watermark = watermark
    return truth


def _add(windows: list[list], win: Win, start: int, end: int, event: dict) -> None:
    if win.kind != "session":
        for w in windows:
            if w[0] == start:
                w[2].append(event)
                w[3]["changed"] = True
                return
        windows.append([start, end, [event], {"changed": True, "in_sink": set()}])
        return
    merged = [start, end, [event], {"changed": True, "in_sink": set()}]
    rest = []
    for w in windows:
        if w[0] <= merged[1] and merged[0] <= w[1]:  # overlap or touch: one session
            merged[0], merged[1] = min(merged[0], w[0]), max(merged[1], w[1])
            merged[2] += w[2]
            merged[3]["in_sink"] |= w[3]["in_sink"]
        else:
            rest.append(w)
    # a merge may make the session touch another one: repeat until stable
    changed = True
    while changed:
        changed = False
        for w in list(rest):
            if w[0] <= merged[1] and merged[0] <= w[1]:
                merged[0], merged[1] = min(merged[0], w[0]), max(merged[1], w[1])
                merged[2] += w[2]
                merged[3]["in_sink"] |= w[3]["in_sink"]
                rest.remove(w)
                changed = True
    windows[:] = rest + [merged]


def bounded_windows(events: list[dict], win: Win, *, key, measure, having=lambda row: True,
                    keep=lambda e: True) -> dict[tuple, dict]:
    """Every window over all events (deduplicated), nothing late: Flink's batch execution. One
    batch whose last element is an end-of-input marker at +inf, so every window fires."""
    eof = {"event_id": "__eof__", "t_ms": 2**62, "__eof__": True}
    truth = replay_windows([[*events, eof]], win, delay=0, lateness=0,
                           key=lambda e: "__eof__" if e.get("__eof__") else key(e), measure=measure, having=having,
                           keep=lambda e: e.get("__eof__") or keep(e))
    return {k: v for k, v in truth.table.items() if k[0] != "__eof__"}
