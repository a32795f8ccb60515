"""Independent oracles: plain Python over the landing-zone files, written without lakestream code.

* ``validate`` re-states the payments record contract from the issue (not from streaming/io/parse.py).
* ``bounded_windows`` is the batch truth: every valid event, duplicates removed, grouped per user
  and 5-minute window (pandas).
* ``replay_stream`` replays the files in arrival order, one file per micro-batch, with Spark's
  watermark rule (max event time of earlier batches minus the delay) and Flink's lateness rule
  (late when the window's end <= watermark), and says which windows a stream has closed and which
  events it must have sent to the late side output.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path

import pandas as pd

STATUSES = {"APPROVED", "DECLINED"}
ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")
ISO = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?(Z|[+-]\d{2}:\d{2})$")
WINDOW_MS = 5 * 60 * 1000


def files_in_arrival_order(folder: Path) -> list[Path]:
    return sorted(p for p in Path(folder).iterdir() if not p.name.startswith((".", "_")))


def read_lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def validate(line: str) -> dict | None:
    """The payment as a dict with ``t_ms`` and ``amount`` (Decimal), or None if it must be quarantined."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    for name in ("event_id", "card_id", "user_id", "merchant_id"):
        if not isinstance(record.get(name), (str, int)) or not ID.match(str(record[name])):
            return None
    if not isinstance(record.get("currency"), str) or not re.fullmatch(r"[A-Z]{3}", record["currency"]):
        return None
    if record.get("status") not in STATUSES:
        return None
    when = record.get("event_time")
    if not isinstance(when, str) or not ISO.match(when):
        return None
    try:
        moment = datetime.fromisoformat(when.replace("Z", "+00:00"))
        amount = Decimal(str(record.get("amount")))
    except (ValueError, InvalidOperation):
        return None
    if not amount.is_finite() or amount < 0 or amount.as_tuple().exponent < -2 or isinstance(record.get("amount"), bool):
        return None
    # the contract's decimal: plain notation, at most 12 integer digits (so any sum fits decimal(18,2))
    if amount >= Decimal(10) ** 12 or "e" in str(record.get("amount")).lower():
        return None
    return {**record, "t_ms": int(moment.timestamp() * 1000), "amount": amount}


def window_of(t_ms: int) -> int:
    return t_ms - t_ms % WINDOW_MS


def _measures(events: list[dict]) -> dict[tuple[str, int], tuple[int, int, int, Decimal]]:
    acc: dict = defaultdict(lambda: [0, 0, 0, Decimal("0")])
    for e in events:
        row = acc[(e["user_id"], window_of(e["t_ms"]))]
        row[0] += 1
        row[1] += e["status"] == "APPROVED"
        row[2] += e["status"] == "DECLINED"
        row[3] += e["amount"]
    return {k: tuple(v) for k, v in acc.items()}


def bounded_windows(folder: Path, start_ms: int | None = None, end_ms: int | None = None) -> pd.DataFrame:
    """pandas: all valid events once per event_id, per user and window starting in [start, end)."""
    seen: dict[str, dict] = {}
    for path in files_in_arrival_order(folder):
        for line in read_lines(path):
            event = validate(line)
            if event is not None:
                seen.setdefault(str(event["event_id"]), event)
    frame = pd.DataFrame(list(seen.values()))
    frame["window_start_ms"] = frame["t_ms"] - frame["t_ms"] % WINDOW_MS
    if start_ms is not None:
        frame = frame[(frame["window_start_ms"] >= start_ms) & (frame["window_start_ms"] < end_ms)]
    frame["approved"] = (frame["status"] == "APPROVED").astype(int)
    frame["declined"] = (frame["status"] == "DECLINED").astype(int)
    out = frame.groupby(["user_id", "window_start_ms"]).agg(
        event_count=("event_id", "size"),
        approved_count=("approved", "sum"),
        declined_count=("declined", "sum"),
        amount_sum=("amount", lambda s: sum(s, Decimal("0"))),
    )
    return out.reset_index()


@dataclass
class StreamTruth:
    closed: dict[tuple[str, int], tuple] = field(default_factory=dict)
    late_ids: set[str] = field(default_factory=set)
    late_by_window: dict[tuple[str, int], int] = field(default_factory=lambda: defaultdict(int))
    watermark_ms: int | None = None
    valid_lines: int = 0
    invalid_lines: int = 0
    lines: int = 0


def replay_stream(batches: list[list[str]], delay_ms: int = 5000) -> StreamTruth:
    truth = StreamTruth()
    watermark = None
    seen: set[str] = set()
    on_time: list[dict] = []
    for lines in batches:
        batch_max = None
        for line in lines:
            truth.lines += 1
            event = validate(line)
            if event is None:
                truth.invalid_lines += 1
                continue
            truth.valid_lines += 1
            batch_max = event["t_ms"] if batch_max is None else max(batch_max, event["t_ms"])
            key = str(event["event_id"])
            if key in seen:
                continue
            seen.add(key)
            window_end = window_of(event["t_ms"]) + WINDOW_MS
            if watermark is not None and window_end <= watermark:
                truth.late_ids.add(key)
                truth.late_by_window[(event["user_id"], window_of(event["t_ms"]))] += 1
            else:
                on_time.append(event)
        if batch_max is not None:
            candidate = batch_max - delay_ms
            watermark = candidate if watermark is None else max(watermark, candidate)
    truth.watermark_ms = watermark
    truth.closed = {k: v for k, v in _measures(on_time).items() if watermark is not None and k[1] + WINDOW_MS <= watermark}
    return truth
