"""Deterministic synthetic landing zone: payment and login events as JSON-lines files.

Files are written in *arrival* order, one per ``file_seconds`` of arrival time, atomically (a
hidden temporary file, then a rename), with strictly increasing modification times, so Spark's
file source reads them in arrival order and late events land in later files, as in a real
landing zone. The same configuration always writes the same bytes to the same file names, so
re-running is safe (existing identical files are left alone).

Every event arrives ``U(0, out_of_orderness)`` after its event time; a ``late_fraction`` of them
``U(late_min, late_max)`` after it. A ``duplicate_fraction`` is delivered a second time (same
``event_id`` and content) up to 30 s later, and ``malformed_fraction`` extra lines are broken
(invalid JSON, or JSON that violates the schema).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np

from .durations import epoch_ms, from_epoch_ms, iso_ms, to_ms

DEFAULT_START = datetime(2026, 11, 20, tzinfo=timezone.utc)


@dataclass(frozen=True)
class GeneratorConfig:
    seed: int = 42
    start: datetime = DEFAULT_START
    duration: timedelta = timedelta(hours=1)
    rate: float = 100.0  # payments per second of event time; logins at login_ratio of it
    login_ratio: float = 0.25
    users: int = 500
    merchants: int = 200
    skew: float = 1.1  # Zipf exponent of user activity (0: uniform)
    out_of_orderness: timedelta = timedelta(seconds=5)
    late_fraction: float = 0.005
    late_min: timedelta = timedelta(minutes=2)
    late_max: timedelta = timedelta(minutes=20)
    duplicate_fraction: float = 0.002
    malformed_fraction: float = 0.001
    file_seconds: int = 60

    def __post_init__(self) -> None:
        from .errors import ConfigError

        for name in ("late_fraction", "duplicate_fraction", "malformed_fraction"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ConfigError(f"generator {name} must be between 0 and 1, got {value}")
        if self.rate <= 0 or self.users < 1 or self.merchants < 1 or self.file_seconds < 1:
            raise ConfigError("generator rate, users, merchants and file_seconds must be positive")
        if self.duration <= timedelta(0):
            raise ConfigError(f"generator duration must be positive, got {self.duration}")
        if self.late_max < self.late_min:
            raise ConfigError("generator late_max must not be below late_min")


@dataclass
class SourceReport:
    source: str
    files: int = 0
    files_skipped: int = 0
    lines: int = 0
    events: int = 0
    duplicates: int = 0
    malformed: int = 0
    late: int = 0
    file_names: list[str] = field(default_factory=list)


_MALFORMED_JSON = ('{"event_id": "broken-{i}", "event_time": ', "not json at all #{i}", "[{i}, 2, 3]", "")


def _user_weights(cfg: GeneratorConfig) -> np.ndarray:
    ranks = np.arange(1, cfg.users + 1, dtype=float)
    weights = 1.0 / ranks**cfg.skew
    return weights / weights.sum()


def _simulate(cfg: GeneratorConfig, source: str, rate: float) -> tuple[np.ndarray, list[str], SourceReport]:
    """All lines of one source with their arrival times (ms), unsorted."""
    salt = {"payments": 1, "logins": 2}[source]
    rng = np.random.default_rng([cfg.seed, salt, epoch_ms(cfg.start)])
    start_ms, dur_ms = epoch_ms(cfg.start), to_ms(cfg.duration)
    n = int(round(rate * dur_ms / 1000))
    t = start_ms + np.sort(rng.integers(0, dur_ms, n))
    user = rng.choice(cfg.users, size=n, p=_user_weights(cfg))
    delay = rng.integers(0, max(1, to_ms(cfg.out_of_orderness)), n)
    late = rng.random(n) < cfg.late_fraction
    delay[late] = rng.integers(to_ms(cfg.late_min), to_ms(cfg.late_max) + 1, int(late.sum()))
    arrival = t + delay
    prefix = f"{source[0]}{cfg.seed}-{start_ms // 1000}"
    if source == "payments":
        cards = rng.integers(0, 3, n) % (1 + user % 3)
        merchant = rng.integers(0, cfg.merchants, n)
        cents = np.maximum(1, np.round(rng.lognormal(3.5, 1.0, n) * 100)).astype(np.int64)
        risky = (user % 25) == 0
        declined = rng.random(n) < np.where(risky, 0.45, 0.06)
        currencies = np.array(["EUR", "USD", "GBP"])[user % 3]
        records = [
            {
                "event_id": f"{prefix}-{i:08d}",
                "event_time": iso_ms(from_epoch_ms(int(t[i]))),
                "card_id": f"c{user[i]:05d}-{cards[i]}",
                "user_id": f"u{user[i]:05d}",
                "merchant_id": f"m{merchant[i]:04d}",
                "amount": float(f"{cents[i] // 100}.{cents[i] % 100:02d}"),
                "currency": str(currencies[i]),
                "status": "DECLINED" if declined[i] else "APPROVED",
            }
            for i in range(n)
        ]
    else:
        failed = rng.random(n) < np.where((user % 20) == 0, 0.5, 0.1)
        octets = rng.integers(1, 255, (n, 2))
        records = [
            {
                "event_id": f"{prefix}-{i:08d}",
                "event_time": iso_ms(from_epoch_ms(int(t[i]))),
                "user_id": f"u{user[i]:05d}",
                "status": "FAILED" if failed[i] else "SUCCESS",
                "ip": f"10.{user[i] % 250}.{octets[i, 0]}.{octets[i, 1]}",
            }
            for i in range(n)
        ]
    lines = [json.dumps(r, separators=(",", ":")) for r in records]
    dup = np.flatnonzero(rng.random(n) < cfg.duplicate_fraction)
    dup_arrival = arrival[dup] + rng.integers(0, 30_000, dup.size)
    m = int(round(n * cfg.malformed_fraction))
    bad_arrival = start_ms + rng.integers(0, dur_ms, m)
    bad_lines = [_malformed(k, lines[int(rng.integers(0, n))] if n else "{}", prefix) for k in range(m)]
    report = SourceReport(source=source, events=n, duplicates=int(dup.size), malformed=m, late=int(late.sum()))
    all_arrival = np.concatenate([arrival, dup_arrival, bad_arrival])
    return all_arrival, lines + [lines[i] for i in dup] + bad_lines, report


def _malformed(k: int, template: str, prefix: str) -> str:
    """The k-th broken line: alternately invalid JSON and schema violations of a real record."""
    kind = k % 8
    if kind < 4:
        text = _MALFORMED_JSON[kind].replace("{i}", f"{prefix}-{k}")
        return text if text else f"   #{prefix}-{k}"
    record = json.loads(template)
    record["event_id"] = f"{prefix}-bad-{k:06d}"
    if kind == 4:
        record.pop("user_id", None)
    elif kind == 5:
        record["event_time"] = "yesterday at noon"
    elif kind == 6:
        record["status"] = "MAYBE"
    elif "amount" in record:
        record["amount"] = "twelve"
    else:
        record["ip"] = "999.1.1.1"
    return json.dumps(record, separators=(",", ":"))


def _write_files(folder: Path, source: str, seed: int, arrival: np.ndarray, lines: list[str], file_ms: int,
                 origin_ms: int, report: SourceReport) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    order = np.argsort(arrival, kind="stable")
    buckets = (arrival[order] - origin_ms) // file_ms
    mtime_ns = time.time_ns()
    boundaries = np.flatnonzero(np.diff(buckets)) + 1
    for chunk in np.split(np.arange(order.size), boundaries):
        if chunk.size == 0:
            continue
        file_start = origin_ms + int(buckets[chunk[0]]) * file_ms
        name = f"{source}-s{seed}-{from_epoch_ms(file_start).strftime('%Y%m%dT%H%M%S')}Z.jsonl"
        text = "\n".join(lines[i] for i in order[chunk]) + "\n"
        path = folder / name
        report.lines += chunk.size
        report.file_names.append(name)
        if path.exists() and path.read_text() == text:
            report.files_skipped += 1
            continue
        tmp = folder / f".{name}.tmp"
        tmp.write_text(text)
        mtime_ns = max(mtime_ns + 1_000_000, time.time_ns())  # strictly increasing, ms apart
        os.utime(tmp, ns=(mtime_ns, mtime_ns))
        os.replace(tmp, path)
        report.files += 1


def generate(cfg: GeneratorConfig, landing: str | Path, sources: tuple[str, ...] = ("payments", "logins")) -> dict[str, SourceReport]:
    """Write the configured events into ``landing/<source>/``; returns a report per source."""
    reports = {}
    for source in sources:
        rate = cfg.rate if source == "payments" else cfg.rate * cfg.login_ratio
        arrival, lines, report = _simulate(cfg, source, rate)
        _write_files(Path(landing) / source, source, cfg.seed, arrival, lines, cfg.file_seconds * 1000,
                     epoch_ms(cfg.start), report)
        reports[source] = report
    manifest = Path(landing) / "_manifests" / f"seed{cfg.seed}-{epoch_ms(cfg.start) // 1000}.json"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({k: {**asdict(v), "file_names": len(v.file_names)} for k, v in reports.items()}, indent=1))
    return reports


def follow(cfg: GeneratorConfig, landing: str | Path, *, ticks: int | None = None, echo=print) -> None:
    """Produce in real time: every ``file_seconds`` write the lines that have 'arrived' by then."""
    tick = 0
    step = timedelta(seconds=cfg.file_seconds)
    start = datetime.now(timezone.utc).replace(microsecond=0)
    pending: list[tuple[int, str]] = []
    while ticks is None or tick < ticks:
        window = replace(cfg, seed=cfg.seed + tick, start=start + tick * step, duration=step)
        for source in ("payments", "logins"):
            rate = cfg.rate if source == "payments" else cfg.rate * cfg.login_ratio
            arrival, lines, _ = _simulate(window, source, rate)
            pending.extend((int(a), source + "\t" + line) for a, line in zip(arrival, lines))
        due_ms = epoch_ms(start + (tick + 1) * step)
        due = [p for p in pending if p[0] < due_ms]
        pending = [p for p in pending if p[0] >= due_ms]
        for source in ("payments", "logins"):
            rows = [(a, line.split("\t", 1)[1]) for a, line in due if line.startswith(source + "\t")]
            if rows:
                report = SourceReport(source=source)
                _write_files(Path(landing) / source, source, cfg.seed + tick, np.array([a for a, _ in rows]),
                             [line for _, line in rows], to_ms(step) * 10**6, epoch_ms(start + tick * step), report)
        echo(f"follow: tick {tick}: wrote {len(due):,} lines ({len(pending):,} still in flight)")
        tick += 1
        sleep_s = (start + tick * step - datetime.now(timezone.utc)).total_seconds()
        if sleep_s > 0 and (ticks is None or tick < ticks):
            time.sleep(sleep_s)
