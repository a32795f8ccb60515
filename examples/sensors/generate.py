"""Sample data for the sensors project: CSV files of readings, one file per minute of arrival.

    python -m sensors.generate LANDING_FOLDER [--minutes 20] [--devices 12] [--seed 1]

(with the project's parent folder on PYTHONPATH; ``make`` targets and the tests do that). It writes
into ``LANDING_FOLDER/sensor_readings``: readings every 10 s per device; two devices overheat (one
for 7 minutes, which raises an alert, one for 3, which does not); about 1% of readings arrive 3
minutes late (some behind the watermark: the late side output), 1% twice, and a few lines are bad
(a temperature of "hot", a missing device, an unknown site): the quarantine. Deterministic per seed;
a file already there is never rewritten.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

HEADER = "reading_id,device_id,site,read_at,temperature,humidity,battery_ok"
START = datetime(2026, 11, 20, 10, 0, tzinfo=timezone.utc)
SITES = ("north", "south", "east")


@dataclass
class Generated:
    files: list[Path]
    readings: int
    late: int
    duplicates: int
    bad: int

    def __str__(self) -> str:
        folder = self.files[0].parent if self.files else "(nothing)"
        return (f"{self.readings:,} readings ({self.late} late, {self.duplicates} twice, {self.bad} bad lines) in "
                f"{len(self.files)} files -> {folder}")


def _line(rid: int, device: str, site: str, at: datetime, temperature: float, humidity: float | None, ok: bool) -> str:
    stamp = at.strftime("%Y-%m-%dT%H:%M:%S") + f".{at.microsecond // 1000:03d}Z"
    hum = "" if humidity is None else f"{humidity:.2f}"
    return f"r-{rid:x},{device},{site},{stamp},{temperature:.1f},{hum},{'true' if ok else 'false'}"


def generate(landing: str | Path, minutes: int = 20, devices: int = 12, seed: int = 1) -> Generated:
    rng = random.Random(seed)
    folder = Path(landing) / "sensor_readings"
    folder.mkdir(parents=True, exist_ok=True)
    arrivals: dict[int, list[str]] = {}
    rid = late = dups = bad = readings = 0
    for d in range(devices):
        device, site = f"dev-{d:03d}", SITES[d % len(SITES)]
        base = 18 + rng.random() * 8
        for step in range(minutes * 6):
            at = START + timedelta(seconds=10 * step, milliseconds=rng.randrange(1000))
            minute = step // 6
            temperature = base + rng.uniform(-1.5, 1.5)
            if d == 0 and 4 <= minute < 11:  # a 7-minute spell: an alert 5 minutes in
                temperature = 85 + rng.uniform(0, 10)
            if d == 1 and 6 <= minute < 9:  # a 3-minute spell: no alert
                temperature = 82 + rng.uniform(0, 5)
            humidity = None if rng.random() < 0.05 else 30 + rng.random() * 40
            rid += 1
            readings += 1
            line = _line(rid, device, site, at, temperature, humidity, rng.random() > 0.02)
            arrive = minute
            if rng.random() < 0.01:
                arrive, late = minute + 3, late + 1
            arrivals.setdefault(arrive, []).append(line)
            if rng.random() < 0.01:
                arrivals.setdefault(arrive + 1, []).append(line)
                dups += 1
    for minute, text in ((2, "r-bad1,dev-001,north,2026-11-20T10:02:00Z,hot,40.00,true"),
                         (5, "r-bad2,,south,2026-11-20T10:05:00Z,21.0,40.00,true"),
                         (8, "r-bad3,dev-002,west,2026-11-20T10:08:00Z,21.0,40.00,true"),
                         (9, "not,a,reading")):
        arrivals.setdefault(minute, []).append(text)
        bad += 1
    files = []
    for minute in sorted(arrivals):
        path = folder / f"{(START + timedelta(minutes=minute)).strftime('%Y%m%dT%H%M')}.csv"
        if not path.exists():
            tmp = path.with_name("." + path.name)
            tmp.write_text("\n".join([HEADER, *arrivals[minute]]) + "\n")
            tmp.rename(path)
        files.append(path)
    return Generated(files=files, readings=readings, late=late, duplicates=dups, bad=bad)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sensors.generate", description=__doc__.splitlines()[0])
    parser.add_argument("landing", help="the landing folder (the settings' 'landing')")
    parser.add_argument("--minutes", type=int, default=20)
    parser.add_argument("--devices", type=int, default=12)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    print(generate(args.landing, args.minutes, args.devices, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
