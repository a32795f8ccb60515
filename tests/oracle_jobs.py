"""Independent oracles of the five issue-3 jobs, in plain Python over the landing-zone files.

Each pattern is re-stated from the issue, not from the job code. Streams are replayed with the
files grouped into the same micro-batches Spark makes (``k`` files per source per batch):

* keyed jobs see the elements of a key in event-time order once the watermark passes them, so a
  keyed stream's output is the pattern over its *on-time* elements (an element is late when its
  event time is at or behind the watermark of the batch that brings it), cut at the final
  watermark. Spark's watermark starts at 0 and follows the rows the job's transform keeps.
"""

from __future__ import annotations

import re
from datetime import datetime
from decimal import Decimal
from pathlib import Path

from tests import oracle

DAY = 24 * 3600 * 1000
FIVE_MIN = 5 * 60 * 1000
IPV4 = re.compile(r"^((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])$")


def validate_login(line: str) -> dict | None:
    import json

    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    for name in ("event_id", "user_id"):
        if not isinstance(record.get(name), str) or not oracle.ID.match(record[name]):
            return None
    if record.get("status") not in ("SUCCESS", "FAILED") or not isinstance(record.get("ip"), str):
        return None
    if not IPV4.match(record["ip"]) or not isinstance(record.get("event_time"), str) or not oracle.ISO.match(record["event_time"]):
        return None
    try:
        moment = datetime.fromisoformat(record["event_time"].replace("Z", "+00:00"))
    except ValueError:
        return None
    return {**record, "t_ms": int(moment.timestamp() * 1000), "source": "logins"}


def validate_payment(line: str) -> dict | None:
    event = oracle.validate(line)
    return None if event is None else {**event, "source": "payments"}


VALIDATORS = {"payments": validate_payment, "logins": validate_login}


def batches(landing: Path, sources: list[str], k: int) -> list[list[dict]]:
    """Valid events per micro-batch: ``k`` files of every source per batch, in arrival order."""
    files = {s: oracle.files_in_arrival_order(Path(landing) / s) for s in sources}
    n = max(-(-len(f) // k) for f in files.values())
    out = []
    for b in range(n):
        events = []
        for source in sources:
            for path in files[source][b * k:(b + 1) * k]:
                events += [e for e in map(VALIDATORS[source], oracle.read_lines(path)) if e is not None]
        out.append(events)
    return out


def keyed_truth(batched: list[list[dict]], keep, delay_ms: int) -> tuple[list[dict], set[str], int]:
    """(on-time kept events, deduplicated; ids of the late ones; the final watermark)."""
    watermark, seen, on_time, late = 0, set(), [], set()
    for events in batched:
        kept = [e for e in events if keep(e)]
        for e in kept:
            if e["event_id"] in seen:
                continue
            seen.add(e["event_id"])
            (late.add(e["event_id"]) if e["t_ms"] <= watermark else on_time.append(e))
        if kept:
            watermark = max(watermark, max(e["t_ms"] for e in kept) - delay_ms)
    return on_time, late, watermark


def by_key(events: list[dict], key: str) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for e in sorted(events, key=lambda e: (e["t_ms"], str(e["event_id"]))):
        groups.setdefault(e[key], []).append(e)
    return groups


def dedup(events: list[dict]) -> list[dict]:
    seen, out = set(), []
    for e in events:
        if e["event_id"] not in seen:
            seen.add(e["event_id"])
            out.append(e)
    return out


def large_amounts(events: list[dict]) -> set[tuple]:
    """(card, event id, previous event id): an amount > 10x the card's previous one of the last 24 h."""
    alerts = set()
    for card, payments in by_key(events, "card_id").items():
        previous = None
        for p in payments:
            if previous is not None and p["t_ms"] < previous["t_ms"] + DAY and p["amount"] > 10 * previous["amount"]:
                alerts.add((card, p["event_id"], previous["event_id"]))
            previous = p
    return alerts


# The table's rows as :func:`rolling_spend` gives them.
ROLLING_SPEND_ROWS = "SELECT card_id, unix_millis(as_of), spend_24h, payments_24h, cause FROM lake.payments.rolling_spend"


def rolling_spend(events: list[dict], until_ms: int) -> set[tuple]:
    """(card, as-of ms, spend, count, cause) on every change of a card's approved spend over the 24
    hours ending at as-of (inclusive), up to ``until_ms``: at each payment (counting the payments
    at the same time up to it, in id order), and when a payment leaves the window 24 h later,
    unless a payment arrives at that very moment (it then reports the new sum itself)."""
    rows = set()
    for card, payments in by_key([e for e in events if e["status"] == "APPROVED"], "card_id").items():
        for i, p in enumerate(payments):
            if p["t_ms"] <= until_ms:
                window = [q for q in payments[: i + 1] if q["t_ms"] > p["t_ms"] - DAY]
                rows.add((card, p["t_ms"], sum(q["amount"] for q in window), len(window), "payment"))
        arrivals = {p["t_ms"] for p in payments}
        for moment in sorted({p["t_ms"] + DAY for p in payments}):
            if moment <= until_ms and moment not in arrivals:
                window = [q for q in payments if moment - DAY < q["t_ms"] <= moment]
                rows.add((card, moment, sum((q["amount"] for q in window), Decimal("0")), len(window), "expiry"))
    return rows


def rolling_spend_streamed(landing: Path, k: int, delay_ms: int = 5_000) -> tuple[set[tuple], set[str]]:
    """rolling_spend as a stream of ``k`` files per batch writes it (its rows, up to the final watermark) and
    the ids of the events it sends to the late side output."""
    batched = batches(landing, ["payments"], k)
    on_time, late, watermark = keyed_truth(batched, lambda e: e["status"] == "APPROVED", delay_ms)
    return rolling_spend([e for e in on_time if e["t_ms"] <= watermark], watermark), late


def suspicious_logins(events: list[dict]) -> set[tuple]:
    """(user, success event id, failures, first, last): 3+ consecutive failures, then a success at
    most 5 minutes after the first failure counted."""
    alerts = set()
    for user, logins in by_key(events, "user_id").items():
        failures: list[int] = []
        for login in logins:
            if login["status"] == "FAILED":
                failures.append(login["t_ms"])
                continue
            recent = [f for f in failures if f >= login["t_ms"] - FIVE_MIN]
            if len(recent) >= 3:
                alerts.add((user, login["event_id"], len(recent), min(recent), max(recent)))
            failures = []
    return alerts
