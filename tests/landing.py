"""Hand-arranged landing zones: one file per micro-batch, written in arrival order."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

T0 = 1_795_168_800_000  # 2026-11-20T10:00:00Z
SEC, MIN = 1000, 60_000


def iso(ms: int) -> str:
    moment = datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def payment(event_id: str, t_ms: int, user: str = "u1", amount: str = "10.00", status: str = "APPROVED",
            card: str | None = None) -> dict:
    return {"event_id": event_id, "event_time": iso(t_ms), "card_id": card or f"c-{user}", "user_id": user,
            "merchant_id": "m1", "amount": float(amount), "currency": "EUR", "status": status}


def login(event_id: str, t_ms: int, user: str = "u1", status: str = "SUCCESS", ip: str = "10.0.0.1") -> dict:
    return {"event_id": event_id, "event_time": iso(t_ms), "user_id": user, "status": status, "ip": ip}


def write_batches(folder: str | Path, batches: list[list[dict | str]], *, start: int = 0) -> list[Path]:
    """Write each batch as one file, with strictly increasing modification times (arrival order)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    base = time.time_ns() - 10**12
    for i, batch in enumerate(batches, start=start):
        path = folder / f"batch-{i:04d}.jsonl"
        lines = [r if isinstance(r, str) else json.dumps(r) for r in batch]
        tmp = folder / f".{path.name}.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        stamp = base + i * 10**9
        os.utime(tmp, ns=(stamp, stamp))
        os.replace(tmp, path)
        paths.append(path)
    return paths


def with_t(records: list[dict]) -> list[dict]:
    """Oracle view of records: the dicts plus ``t_ms``."""
    out = []
    for r in records:
        moment = datetime.fromisoformat(r["event_time"].replace("Z", "+00:00"))
        out.append({**r, "t_ms": int(round(moment.timestamp() * 1000))})
    return out
