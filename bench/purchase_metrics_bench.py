"""purchase_metrics through lakestream vs the equivalent hand-written PySpark queries.

All read the same generated landing zone as a stream (available-now) and write Iceberg tables:

* ``lakestream``: the job (validation with reasons -> quarantine table, dedup by event_id,
  5-minute windows with a 5 s watermark, late side output, exactly-once commits, engine state);
* ``plain+quarantine``: what a Spark user writes for the same outputs: the aggregation query
  (typed JSON, ``withWatermark`` + ``dropDuplicatesWithinWatermark`` + ``groupBy(window)``) and a
  second query over the same files that keeps malformed and schema-violating lines with a reason.
  Plain Spark has no late side output (late records are dropped), so that part has no counterpart;
* ``plain``: the aggregation query alone, which silently drops bad and late records.

After one untimed warm-up run of each, rounds alternate in one JVM, each run with fresh
checkpoints and tables; the best round of each is compared. Run: ``make bench`` or
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import plain_metrics  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

from lakestream.generator import GeneratorConfig, generate  # noqa: E402
from streaming.project import get_job  # noqa: E402
from streaming.io.parse import AMOUNT_TYPE  # noqa: E402
from streaming.run.runner import run_stream  # noqa: E402
from streaming.spark.session import get_spark  # noqa: E402
from streaming.settings import Settings  # noqa: E402
from streaming.io.tables import all_tables  # noqa: E402

STEPS: list[dict[str, float]] = []  # per lakestream run: seconds per step of the batch handler
PLAIN_TABLE = "lake.bench.plain_purchase_metrics"
PLAIN_QUARANTINE = "lake.bench.plain_quarantine"
SCHEMA = (
    "event_id string, event_time timestamp, card_id string, user_id string, merchant_id string, "
    f"amount decimal({AMOUNT_TYPE.precision},{AMOUNT_TYPE.scale}), currency string, status string"
)


def drop_job_tables(spark, job) -> None:
    for table in all_tables(job):
        spark.sql(f"DROP TABLE IF EXISTS {table.name} PURGE")


def run_lakestream(spark, settings: Settings, files_per_trigger: int | None) -> float:
    job = get_job("purchase_metrics", settings)
    drop_job_tables(spark, job)
    shutil.rmtree(settings.checkpoint_dir(job.name), ignore_errors=True)
    if files_per_trigger:
        settings = settings.with_job(job.name, max_files_per_trigger=files_per_trigger)
    started = time.perf_counter()
    report = run_stream(spark, settings, job, available_now=True, progress=None)
    seconds = time.perf_counter() - started
    STEPS.append(report.step_seconds)
    return seconds


def _fresh(spark, settings: Settings, table: str, columns: str, partition: str, checkpoint: str) -> str:
    spark.sql("CREATE NAMESPACE IF NOT EXISTS lake.bench")
    spark.sql(f"DROP TABLE IF EXISTS {table} PURGE")
    spark.sql(f"CREATE TABLE {table} ({columns}) USING iceberg {partition}")
    path = f"{settings.checkpoints}/{checkpoint}"
    shutil.rmtree(path, ignore_errors=True)
    return path


def start_plain_metrics(spark, settings: Settings, files_per_trigger: int | None):
    """The aggregation as a Spark user writes it: typed JSON, watermark, streaming dedup, window."""
    checkpoint = _fresh(
        spark, settings, PLAIN_TABLE,
        "user_id string, window_start timestamp, window_end timestamp, event_count bigint, approved_count bigint, "
        "declined_count bigint, amount_sum decimal(38,2)", "PARTITIONED BY (days(window_start))", "bench-plain",
    )
    reader = spark.readStream.schema(SCHEMA)
    if files_per_trigger:
        reader = reader.option("maxFilesPerTrigger", files_per_trigger)
    payments = reader.json(settings.landing_dir("payments")).where(F.col("event_time").isNotNull())
    metrics = plain_metrics(payments.withWatermark("event_time", "5 seconds").dropDuplicatesWithinWatermark(["event_id"]))
    return (
        metrics.writeStream.format("iceberg").outputMode("append").option("checkpointLocation", checkpoint)
        .trigger(availableNow=True).toTable(PLAIN_TABLE)
    )


_ID = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$"
_ISO = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?(Z|[+-][0-9]{2}:[0-9]{2})$"


def start_plain_quarantine(spark, settings: Settings, files_per_trigger: int | None):
    """What a Spark user adds so bad lines are kept with a reason: a second query over the same files."""
    checkpoint = _fresh(
        spark, settings, PLAIN_QUARANTINE,
        "source_file string, raw_line string, reason string", "", "bench-plain-quarantine",
    )
    fields = ["event_id", "event_time", "card_id", "user_id", "merchant_id", "amount", "currency", "status"]
    schema = ", ".join(f"{f} string" for f in fields) + ", _corrupt string"
    reader = spark.readStream.format("text")
    if files_per_trigger:
        reader = reader.option("maxFilesPerTrigger", files_per_trigger)
    raw = reader.load(settings.landing_dir("payments")).select("value", F.col("_metadata.file_path").alias("file"))
    j = raw.select("value", "file", F.from_json("value", schema, {"columnNameOfCorruptRecord": "_corrupt"}).alias("j"))
    j = j.select("value", "file", F.col("j").isNull().alias("_null"), "j.*")
    c = F.col
    reason = F.coalesce(
        F.when(c("_null") | c("_corrupt").isNotNull(), F.lit("malformed JSON")),
        *[F.when(c(f).isNull(), F.lit(f"missing field {f}")) for f in fields],
        *[F.when(~c(f).rlike(_ID), F.lit(f"invalid {f}")) for f in ("event_id", "card_id", "user_id", "merchant_id")],
        F.when(~c("event_time").rlike(_ISO) | F.to_timestamp("event_time").isNull(), F.lit("invalid event_time")),
        F.when(~c("amount").rlike(r"^[0-9]{1,12}(\.[0-9]{1,2})?$"), F.lit("invalid amount")),
        F.when(~c("currency").rlike("^[A-Z]{3}$"), F.lit("invalid currency")),
        F.when(~c("status").isin("APPROVED", "DECLINED"), F.lit("invalid status")),
    )
    bad = j.select(c("file").alias("source_file"), c("value").alias("raw_line"), reason.alias("reason"))
    return (
        bad.where(c("reason").isNotNull()).writeStream.format("iceberg").outputMode("append")
        .option("checkpointLocation", checkpoint).trigger(availableNow=True).toTable(PLAIN_QUARANTINE)
    )


def _await(queries) -> None:
    for query in queries:
        query.awaitTermination()


def run_plain(spark, settings: Settings, files_per_trigger: int | None) -> float:
    started = time.perf_counter()
    _await([start_plain_metrics(spark, settings, files_per_trigger)])
    return time.perf_counter() - started


def run_plain_with_quarantine(spark, settings: Settings, files_per_trigger: int | None) -> float:
    started = time.perf_counter()
    _await([start_plain_metrics(spark, settings, files_per_trigger),
            start_plain_quarantine(spark, settings, files_per_trigger)])
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", default=str(Path(__file__).resolve().parent / "out"))
    parser.add_argument("--rate", type=float, default=150.0, help="payments/s over one hour of event time")
    parser.add_argument("--duration", default=60, type=int, help="minutes of event time")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--files-per-trigger", type=int, default=None, help="default: all files in one batch")
    args = parser.parse_args()

    settings = Settings.load({"LAKESTREAM_HOME": args.home})
    cfg = replace(GeneratorConfig(), rate=args.rate, duration=timedelta(minutes=args.duration))
    report = generate(cfg, settings.landing, sources=("payments",))["payments"]
    lines = report.lines
    print(f"data: {lines:,} lines ({report.events:,} events) in {len(report.file_names)} files; "
          f"files per trigger: {args.files_per_trigger or 'all'}", flush=True)
    spark = get_spark(settings)
    runs = {"lakestream": run_lakestream, "plain+quarantine": run_plain_with_quarantine, "plain": run_plain}
    print("warm-up: one untimed run of each (JIT, catalog, Python workers)", flush=True)
    for fn in runs.values():
        fn(spark, settings, args.files_per_trigger)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_no in range(1, args.rounds + 1):
        for name, fn in runs.items():
            seconds = fn(spark, settings, args.files_per_trigger)
            times[name].append(seconds)
            print(f"round {round_no}: {name:17} {seconds:7.2f} s  {lines / seconds:10,.0f} events/s", flush=True)
    best = {name: min(values) for name, values in times.items()}
    print()
    print(f"{'':19}{'best s':>9}{'median s':>10}{'events/s':>12}")
    for name in runs:
        print(f"{name:19}{best[name]:9.2f}{statistics.median(times[name]):10.2f}{lines / best[name]:12,.0f}")
    best_round = STEPS[1:][times["lakestream"].index(best["lakestream"])]  # STEPS[0] is the warm-up
    handler = sum(best_round.values())
    print(f"\nlakestream best round, inside the batch handler ({handler:.2f} s of {best['lakestream']:.2f} s; "
          "the rest is Spark's source planning and offset/commit logs):")
    for step, seconds in best_round.items():
        print(f"  {step:20}{seconds:7.2f} s")
    print()
    for name, label in (("plain+quarantine", "same outputs but the late side output (target < +10%)"),
                        ("plain", "drops bad and late records silently")):
        ratio = best[name] / best["lakestream"]
        print(f"lakestream vs {name:17} throughput ratio {ratio:.2f}, overhead {1 / ratio - 1:+.0%}  ({label})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
