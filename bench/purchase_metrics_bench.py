"""purchase_metrics through lakestream vs the equivalent hand-written PySpark query.

Both read the same generated landing zone as a stream (available-now), deduplicate by event_id,
aggregate per user and 5-minute window with a 5 s watermark and write an Iceberg table. The
hand-written query is what a Spark user writes today (``withWatermark`` +
``dropDuplicatesWithinWatermark`` + ``groupBy(window)`` + Iceberg streaming sink); it silently
drops malformed and late lines, which lakestream quarantines and side-outputs.

After one untimed warm-up run of each, rounds alternate (lakestream, plain, lakestream, plain,
...) in one JVM, each with a fresh checkpoint and table; the best round of each is compared. Run: ``make bench`` or
``python bench/purchase_metrics_bench.py --rate 150 --rounds 2 [--files-per-trigger 1]``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyspark.sql import functions as F  # noqa: E402

from streaming.generator import GeneratorConfig, generate  # noqa: E402
from streaming.jobs import get_job  # noqa: E402
from streaming.parse import AMOUNT_TYPE  # noqa: E402
from streaming.runner import run_stream  # noqa: E402
from streaming.session import get_spark  # noqa: E402
from streaming.settings import Settings  # noqa: E402

PLAIN_TABLE = "lake.bench.plain_purchase_metrics"
SCHEMA = (
    "event_id string, event_time timestamp, card_id string, user_id string, merchant_id string, "
    f"amount decimal({AMOUNT_TYPE.precision},{AMOUNT_TYPE.scale}), currency string, status string"
)


def drop_job_tables(spark, job) -> None:
    for table in (job.sink, job.late_sink, job.quarantine):
        spark.sql(f"DROP TABLE IF EXISTS {table.name} PURGE")


def run_lakestream(spark, settings: Settings, files_per_trigger: int | None) -> float:
    job = get_job("purchase_metrics", settings)
    drop_job_tables(spark, job)
    shutil.rmtree(settings.checkpoint_dir(job.name), ignore_errors=True)
    if files_per_trigger:
        settings = settings.with_job(job.name, max_files_per_trigger=files_per_trigger)
    started = time.perf_counter()
    run_stream(spark, settings, job, available_now=True, progress=None)
    return time.perf_counter() - started


def run_plain(spark, settings: Settings, files_per_trigger: int | None) -> float:
    spark.sql("CREATE NAMESPACE IF NOT EXISTS lake.bench")
    spark.sql(f"DROP TABLE IF EXISTS {PLAIN_TABLE} PURGE")
    spark.sql(
        f"CREATE TABLE {PLAIN_TABLE} (user_id string, window_start timestamp, window_end timestamp, "
        "event_count bigint, approved_count bigint, declined_count bigint, amount_sum decimal(38,2)) "
        "USING iceberg PARTITIONED BY (days(window_start))"
    )
    checkpoint = f"{settings.checkpoints}/bench-plain"
    shutil.rmtree(checkpoint, ignore_errors=True)
    reader = spark.readStream.schema(SCHEMA)
    if files_per_trigger:
        reader = reader.option("maxFilesPerTrigger", files_per_trigger)
    payments = reader.json(settings.landing_dir("payments")).where(F.col("event_time").isNotNull())
    metrics = (
        payments.withWatermark("event_time", "5 seconds")
        .dropDuplicatesWithinWatermark(["event_id"])
        .groupBy("user_id", F.window("event_time", "5 minutes"))
        .agg(
            F.count(F.lit(1)).alias("event_count"),
            F.sum((F.col("status") == "APPROVED").cast("long")).alias("approved_count"),
            F.sum((F.col("status") == "DECLINED").cast("long")).alias("declined_count"),
            F.sum("amount").cast("decimal(38,2)").alias("amount_sum"),
        )
        .select("user_id", F.col("window.start").alias("window_start"), F.col("window.end").alias("window_end"),
                "event_count", "approved_count", "declined_count", "amount_sum")
    )
    started = time.perf_counter()
    query = (
        metrics.writeStream.format("iceberg").outputMode("append").option("checkpointLocation", checkpoint)
        .trigger(availableNow=True).toTable(PLAIN_TABLE)
    )
    query.awaitTermination()
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", default=str(Path(__file__).resolve().parent / "out"))
    parser.add_argument("--rate", type=float, default=150.0, help="payments/s over one hour of event time")
    parser.add_argument("--duration", default=60, type=int, help="minutes of event time")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--files-per-trigger", type=int, default=None, help="default: all files in one batch")
    args = parser.parse_args()

    settings = Settings.load({"LAKESTREAM_HOME": args.home})
    cfg = replace(GeneratorConfig(), rate=args.rate, duration=timedelta(minutes=args.duration))
    report = generate(cfg, settings.landing, sources=("payments",))["payments"]
    lines = report.lines
    print(f"data: {lines:,} lines ({report.events:,} events) in {len(report.file_names)} files; "
          f"files per trigger: {args.files_per_trigger or 'all'}", flush=True)
    spark = get_spark(settings)
    print("warm-up: one untimed run of each (JIT, catalog, Python workers)", flush=True)
    run_lakestream(spark, settings, args.files_per_trigger)
    run_plain(spark, settings, args.files_per_trigger)
    times: dict[str, list[float]] = {"lakestream": [], "plain": []}
    for round_no in range(1, args.rounds + 1):
        for name, fn in (("lakestream", run_lakestream), ("plain", run_plain)):
            seconds = fn(spark, settings, args.files_per_trigger)
            times[name].append(seconds)
            print(f"round {round_no}: {name:10} {seconds:7.2f} s  {lines / seconds:10,.0f} events/s", flush=True)
    best = {name: min(values) for name, values in times.items()}
    ours, plain = lines / best["lakestream"], lines / best["plain"]
    print()
    print(f"{'':12}{'best s':>9}{'median s':>10}{'events/s':>12}")
    for name in ("lakestream", "plain"):
        print(f"{name:12}{best[name]:9.2f}{statistics.median(times[name]):10.2f}{lines / best[name]:12,.0f}")
    overhead = best["lakestream"] / best["plain"] - 1
    print(f"ratio lakestream/plain throughput: {ours / plain:.2f}  (overhead {overhead:+.0%}; target < +10%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
