"""Bounded runs at scale: backfill one day of events at the generator's default rate.

Generates ``--hours`` (default 24) of payments and logins at ``--rate`` payments/s (default 100,
the generator's default) once, then backfills the day with the bounded twin of
``purchase_metrics`` (windowed) and of ``large_amount_alerts`` (keyed state in Python), and
prints lines/s and events/s for each, side by side. Run: ``make bench-backfill`` or
``python bench/backfill_bench.py [--hours 24] [--rate 100] [--jobs purchase_metrics,rolling_spend]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batch.backfill import backfill  # noqa: E402
from lakestream.generator import GeneratorConfig, generate  # noqa: E402
from streaming.project import get_job  # noqa: E402
from streaming.spark.session import get_spark  # noqa: E402
from streaming.settings import Settings  # noqa: E402
from streaming.io.tables import all_tables  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--rate", type=float, default=100.0, help="payments per second of event time")
    parser.add_argument("--jobs", default="purchase_metrics,large_amount_alerts")
    parser.add_argument("--home", default=str(Path(__file__).resolve().parent / "out" / "backfill"))
    args = parser.parse_args()

    settings = Settings.load({"LAKESTREAM_HOME": args.home})
    cfg = GeneratorConfig(duration=timedelta(hours=args.hours), rate=args.rate, users=5000, merchants=2000)
    started = time.perf_counter()
    reports = generate(cfg, settings.landing)
    lines = sum(r.lines for r in reports.values())
    print(f"landing zone: {lines:,} lines ({', '.join(f'{k}: {v.events:,} events' for k, v in reports.items())}) "
          f"ready in {time.perf_counter() - started:.0f}s ({sum(r.files_skipped for r in reports.values())} files reused)",
          flush=True)
    spark = get_spark(settings)
    start, end = cfg.start, cfg.start + timedelta(days=max(1, -(-int(args.hours) // 24)))
    rows = []
    for name in args.jobs.split(","):
        job = get_job(name, settings)
        for table in all_tables(job):
            spark.sql(f"DROP TABLE IF EXISTS {table.name} PURGE")
        began = time.perf_counter()
        report = backfill(spark, settings, job, start, end, progress=lambda m: print(m, flush=True), force=True)
        seconds = time.perf_counter() - began
        rows.append((name, job.kind, report.stats.lines, report.stats.events, report.stats.rows_written, seconds))
    print()
    print(f"one-day backfill, {args.hours:g} h of events at {args.rate:g} payments/s (2 cores, local[*]):")
    print(f"{'job':22} {'kind':8} {'lines':>12} {'events':>12} {'rows out':>10} {'seconds':>8} {'lines/s':>9} {'events/s':>9}")
    for name, kind, n_lines, events, out, seconds in rows:
        print(f"{name:22} {kind:8} {n_lines:>12,} {events:>12,} {out:>10,} {seconds:>8.0f} {n_lines / seconds:>9,.0f} "
              f"{events / seconds:>9,.0f}")
    if len(rows) == 2:
        print(f"ratio {rows[1][0]} / {rows[0][0]} (events/s): {(rows[1][3] / rows[1][5]) / (rows[0][3] / rows[0][5]):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
