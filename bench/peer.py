"""The peer: what a Spark user writes instead of lakestream, as a script started from a shell.

Text file source, ``from_json``, ``withWatermark`` 5 s, a 5-minute tumbling window per user, Iceberg
append (late and malformed records silently dropped, no dedup, no side output). The session has what a
user of an Iceberg lake sets: the runtime jar, the catalog, UTC, and the same shuffle partitions and
driver memory lakestream's embedded default uses (Spark's own 200 partitions would make the peer slower).

    python bench/peer.py stream  --landing DIR --home DIR [--max-files-per-trigger N]   # availableNow
    python bench/peer.py batch   --landing DIR --home DIR                               # spark.read
    python bench/peer.py live    --landing DIR --home DIR    # Spark's default trigger, until SIGTERM/SIGINT

Prints one line per batch (``BATCH id rows ms``) and ``DONE <rows in table> <seconds>``.
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import sys
import threading
import time

STARTED = time.time()

SCHEMA = ("event_id string, event_time timestamp, card_id string, user_id string, merchant_id string, "
          "amount decimal(18,2), currency string, status string")
TABLE = "lake.peer.purchase_metrics"


def iceberg_jar() -> str:
    import snowpark_connect_deps_iceberg

    folder = os.path.join(os.path.dirname(snowpark_connect_deps_iceberg.__file__), "jars")
    return glob.glob(os.path.join(folder, "iceberg-spark-runtime-3.5_2.12-*.jar"))[0]


def session(home: str):
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master(os.environ.get("PEER_MASTER", "local[*]")).appName("peer")
               .config("spark.jars", iceberg_jar())
               .config("spark.sql.extensions", "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions")
               .config("spark.sql.catalog.lake", "org.apache.iceberg.spark.SparkCatalog")
               .config("spark.sql.catalog.lake.type", "hadoop")
               .config("spark.sql.catalog.lake.warehouse", os.path.join(home, "warehouse"))
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.sql.shuffle.partitions", "4")
               .config("spark.driver.memory", "4g")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               # (a measurement aid, not a speed setting: the bench reads every batch's commit from the checkpoint,
               # and Spark keeps the last 100 only)
               .config("spark.sql.streaming.minBatchesToRetain", "1000"))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    spark.sql("CREATE NAMESPACE IF NOT EXISTS lake.peer")
    spark.sql(f"CREATE TABLE IF NOT EXISTS {TABLE} (user_id string, window_start timestamp, window_end timestamp, "
              "event_count bigint, approved_count bigint, declined_count bigint, amount_sum decimal(38,2)) "
              "USING iceberg PARTITIONED BY (days(window_start))")
    return spark


def metrics(frame):
    from pyspark.sql import functions as F

    return (frame.groupBy("user_id", F.window("event_time", "5 minutes"))
            .agg(F.count(F.lit(1)).alias("event_count"),
                 F.sum((F.col("status") == "APPROVED").cast("long")).alias("approved_count"),
                 F.sum((F.col("status") == "DECLINED").cast("long")).alias("declined_count"),
                 F.sum("amount").cast("decimal(38,2)").alias("amount_sum"))
            .select("user_id", F.col("window.start").alias("window_start"), F.col("window.end").alias("window_end"),
                    "event_count", "approved_count", "declined_count", "amount_sum"))


def payments(text):
    from pyspark.sql import functions as F

    return text.select(F.from_json("value", SCHEMA).alias("p")).select("p.*").where(F.col("event_time").isNotNull())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("stream", "batch", "live"))
    parser.add_argument("--landing", required=True)
    parser.add_argument("--home", required=True)
    parser.add_argument("--max-files-per-trigger", type=int)
    args = parser.parse_args()
    spark = session(args.home)
    if args.mode == "batch":
        metrics(payments(spark.read.format("text").load(args.landing))).writeTo(TABLE).append()
    else:
        reader = spark.readStream.format("text")
        if args.max_files_per_trigger:
            reader = reader.option("maxFilesPerTrigger", args.max_files_per_trigger)
        stream = payments(reader.load(args.landing)).withWatermark("event_time", "5 seconds")
        writer = (metrics(stream).writeStream.format("iceberg").outputMode("append")
                  .option("checkpointLocation", os.path.join(args.home, "checkpoint")))
        if args.mode == "stream":
            writer = writer.trigger(availableNow=True)
        query = writer.toTable(TABLE)
        if args.mode == "live":
            stop = threading.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
            while query.isActive and not stop.is_set():
                stop.wait(0.5)
            query.stop()
        else:
            query.awaitTermination()
        for p in query.recentProgress:
            print(f"BATCH {p['batchId']} {p['numInputRows']} {p['durationMs'].get('triggerExecution', 0)}", flush=True)
    rows = spark.table(TABLE).count()
    print(f"DONE {rows} {time.time() - STARTED:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
