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

from streaming.time import epoch_ms, from_epoch_ms, to_ms

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
        from streaming.errors import ConfigError

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
    files_renamed: int = 0  # files of a minute that already had a file with other content: written under a new name
    lines: int = 0
    events: int = 0
    duplicates: int = 0
    malformed: int = 0
    late: int = 0
    file_names: list[str] = field(default_factory=list)
    last_mtime_ns: int = 0  # files get strictly increasing modification times, across flushes too


_MALFORMED_JSON = ('{"event_id": "broken-{i}", "event_time": ', "not json at all #{i}", "[{i}, 2, 3]", "")


def _user_weights(cfg: GeneratorConfig) -> np.ndarray:
    ranks = np.arange(1, cfg.users + 1, dtype=float)
    weights = 1.0 / ranks**cfg.skew
    return weights / weights.sum()


CHUNK_MS = 3_600_000  # event time is simulated an hour at a time, so a day never sits in memory at once


def _iso(times_ms: np.ndarray) -> np.ndarray:
    """ISO-8601 UTC with milliseconds and a Z, vectorised."""
    return np.char.add(np.datetime_as_string(times_ms.astype("datetime64[ms]"), unit="ms"), "Z")


def _simulate(cfg: GeneratorConfig, source: str, rate: float, chunk: int = 0,
              chunk_ms: int | None = None) -> tuple[np.ndarray, list[str], SourceReport]:
    """The lines of one source whose event time lies in chunk ``chunk`` of ``chunk_ms`` (default:
    the whole duration), with their arrival times (ms), unsorted."""
    salt = {"payments": 1, "logins": 2}[source]
    rng = np.random.default_rng([cfg.seed, salt, epoch_ms(cfg.start), chunk])
    origin, total_ms = epoch_ms(cfg.start), to_ms(cfg.duration)
    chunk_ms = chunk_ms or total_ms
    start_ms = origin + chunk * chunk_ms
    dur_ms = min(chunk_ms, origin + total_ms - start_ms)
    n = int(round(rate * dur_ms / 1000))
    t = start_ms + np.sort(rng.integers(0, dur_ms, n))
    user = rng.choice(cfg.users, size=n, p=_user_weights(cfg))
    delay = rng.integers(0, max(1, to_ms(cfg.out_of_orderness)), n)
    late = rng.random(n) < cfg.late_fraction
    delay[late] = rng.integers(to_ms(cfg.late_min), to_ms(cfg.late_max) + 1, int(late.sum()))
    arrival = t + delay
    prefix = f"{source[0]}{cfg.seed}-{origin // 1000}-{chunk:04d}" if chunk_ms < total_ms else f"{source[0]}{cfg.seed}-{origin // 1000}"
    when = _iso(t)
    if source == "payments":
        cards = rng.integers(0, 3, n) % (1 + user % 3)
        merchant = rng.integers(0, cfg.merchants, n)
        cents = np.maximum(1, np.round(rng.lognormal(3.5, 1.0, n) * 100)).astype(np.int64)
        risky = (user % 25) == 0
        declined = rng.random(n) < np.where(risky, 0.45, 0.06)
        currencies = np.array(["EUR", "USD", "GBP"])[user % 3]
        lines = [
            f'{{"event_id":"{prefix}-{i:08d}","event_time":"{when[i]}","card_id":"c{u:05d}-{c}",'
            f'"user_id":"u{u:05d}","merchant_id":"m{m:04d}","amount":{a / 100!r},"currency":"{cur}",'
            f'"status":"{"DECLINED" if d else "APPROVED"}"}}'
            for i, (u, c, m, a, cur, d) in enumerate(zip(user.tolist(), cards.tolist(), merchant.tolist(),
                                                           cents.tolist(), currencies.tolist(), declined.tolist()))
        ]
    else:
        failed = rng.random(n) < np.where((user % 20) == 0, 0.5, 0.1)
        octets = rng.integers(1, 255, (n, 2))
        lines = [
            f'{{"event_id":"{prefix}-{i:08d}","event_time":"{when[i]}","user_id":"u{u:05d}",'
            f'"status":"{"FAILED" if f else "SUCCESS"}","ip":"10.{u % 250}.{o1}.{o2}"}}'
            for i, (u, f, o1, o2) in enumerate(zip(user.tolist(), failed.tolist(), octets[:, 0].tolist(),
                                                   octets[:, 1].tolist()))
        ]
    dup = np.flatnonzero(rng.random(n) < cfg.duplicate_fraction)
    dup_arrival = arrival[dup] + rng.integers(0, 30_000, dup.size)
    m = int(round(n * cfg.malformed_fraction))
    bad_arrival = start_ms + rng.integers(0, max(1, dur_ms), m)
    bad_when = _iso(bad_arrival - rng.integers(0, max(1, to_ms(cfg.out_of_orderness)), m))
    bad_lines = [_malformed(k, lines[int(rng.integers(0, n))] if n else "{}", prefix, str(bad_when[k])) for k in range(m)]
    report = SourceReport(source=source, events=n, duplicates=int(dup.size), malformed=m, late=int(late.sum()))
    all_arrival = np.concatenate([arrival, dup_arrival, bad_arrival])
    return all_arrival, lines + [lines[i] for i in dup] + bad_lines, report


def _malformed(k: int, template: str, prefix: str, when: str) -> str:
    """The k-th broken line: alternately invalid JSON and schema violations of a real record, stamped with an
    event time ``when`` near its arrival (a broken record arrives when its event happens, like any other: a
    template's own time, from anywhere in the run, would put a valid event time an hour ahead into the input)."""
    kind = k % 8
    if kind < 4:
        text = _MALFORMED_JSON[kind].replace("{i}", f"{prefix}-{k}")
        return text if text else f"   #{prefix}-{k}"
    record = json.loads(template)
    record["event_id"] = f"{prefix}-bad-{k:06d}"
    record["event_time"] = when
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
    mtime_ns = max(time.time_ns(), report.last_mtime_ns)
    boundaries = np.flatnonzero(np.diff(buckets)) + 1
    for chunk in np.split(np.arange(order.size), boundaries):
        if chunk.size == 0:
            continue
        file_start = origin_ms + int(buckets[chunk[0]]) * file_ms
        name = f"{source}-s{seed}-{from_epoch_ms(file_start).strftime('%Y%m%dT%H%M%S')}Z.jsonl"
        text = "\n".join(lines[i] for i in order[chunk]) + "\n"
        path = folder / name
        report.lines += chunk.size
        if path.exists():
            if path.read_text() == text:
                report.file_names.append(name)
                report.files_skipped += 1
                continue
            # Never overwrite a landing file: a stream that read it would never read it again (Spark
            # skips paths it has seen), so the new content goes under a new name.
            stem = name[: -len(".jsonl")]
            n = 2
            while (folder / f"{stem}-{n}.jsonl").exists() and (folder / f"{stem}-{n}.jsonl").read_text() != text:
                n += 1
            name = f"{stem}-{n}.jsonl"
            path = folder / name
            if path.exists():  # this very content was written under the new name before
                report.file_names.append(name)
                report.files_skipped += 1
                continue
            report.files_renamed += 1
        report.file_names.append(name)
        tmp = folder / f".{name}.tmp"
        tmp.write_text(text)
        mtime_ns = max(mtime_ns + 1_000_000, time.time_ns())  # strictly increasing, ms apart
        os.utime(tmp, ns=(mtime_ns, mtime_ns))
        os.replace(tmp, path)
        report.files += 1
        report.last_mtime_ns = mtime_ns


def generate(cfg: GeneratorConfig, landing: str | Path, sources: tuple[str, ...] = ("payments", "logins"),
             echo=None) -> dict[str, SourceReport]:
    """Write the configured events into ``landing/<source>/``; returns a report per source.

    Event time is simulated an hour at a time; after each hour the files of every arrival minute
    that no later hour can add to are written, so memory stays at about an hour of events.
    """
    reports = {}
    total_ms = to_ms(cfg.duration)
    chunks = -(-total_ms // CHUNK_MS)
    file_ms = cfg.file_seconds * 1000
    origin = epoch_ms(cfg.start)
    for source in sources:
        rate = cfg.rate if source == "payments" else cfg.rate * cfg.login_ratio
        report = SourceReport(source=source)
        pending_arrival: list[np.ndarray] = []
        pending_lines: list[str] = []
        for chunk in range(chunks):
            arrival, lines, part = _simulate(cfg, source, rate, chunk, CHUNK_MS if chunks > 1 else None)
            for name in ("events", "duplicates", "malformed", "late"):
                setattr(report, name, getattr(report, name) + getattr(part, name))
            pending_arrival.append(arrival)
            pending_lines += lines
            arrivals = np.concatenate(pending_arrival)
            if chunk < chunks - 1:  # later hours only add arrivals at or after the next hour's start
                cut = origin + (chunk + 1) * CHUNK_MS
                cut -= (cut - origin) % file_ms  # whole files only
            else:
                cut = None
            ready = np.ones(arrivals.size, bool) if cut is None else arrivals < cut
            idx = np.flatnonzero(ready)
            _write_files(Path(landing) / source, source, cfg.seed, arrivals[idx], [pending_lines[i] for i in idx],
                         file_ms, origin, report)
            keep = np.flatnonzero(~ready)
            pending_arrival = [arrivals[keep]]
            pending_lines = [pending_lines[i] for i in keep]
            if echo and chunks > 1:
                echo(f"  {source}: {chunk + 1}/{chunks} hours simulated, {len(report.file_names)} files written")
        reports[source] = report
    manifest = Path(landing) / "_manifests" / f"seed{cfg.seed}-{epoch_ms(cfg.start) // 1000}.json"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({k: {**asdict(v), "file_names": len(v.file_names)} for k, v in reports.items()},
                                   indent=1))
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
