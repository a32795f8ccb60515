"""The peer: what a Spark user writes instead of lakestream, as a script started from a shell.

Text file source, ``from_json``, ``withWatermark`` 5 s, a 5-minute tumbling window per user, Iceberg
append (late and malformed records silently dropped, no dedup, no side output). The session has what a
user of an Iceberg lake sets: the runtime jar, the catalog, UTC, and the same shuffle partitions and
driver memory lakestream's embedded default uses (Spark's own 200 partitions would make the peer slower).

    python bench/peer.py stream  --landing DIR --home DIR [--max-files-per-trigger N]   # availableNow
    python bench/peer.py batch   --landing DIR --home DIR                               # spark.read
    python bench/peer.py live    --landing DIR --home DIR    # Spark's default trigger, until SIGTERM/SIGINT
    python bench/peer.py live-keyed --landing DIR --home DIR # the same for the keyed job (below)

``live-keyed`` is what a Spark user writes instead of the keyed ``large_amount_alerts`` (a payment more than 10x
its card's previous one within 24 h): Spark has no streaming ``lag``, so ``groupBy(card).applyInPandasWithState``
with the previous payment as the group's state (Spark's default state store, no timeout: the 24 h are checked
against the previous payment's time), each batch's payments of a card taken in event-time order, alerts appended
to Iceberg. Unlike lakestream it does not order a card's payments across batches, drops nothing late into a side
table, keeps repeats and drops malformed lines (no quarantine).

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
ALERTS = "lake.peer.large_amount_alerts"
ALERT_SCHEMA = ("card_id string, user_id string, event_id string, event_time timestamp, amount decimal(18,2), "
                "previous_amount decimal(18,2), previous_time timestamp, previous_event_id string, ratio double")
ALERT_COLUMNS = [column.split()[0] for column in ALERT_SCHEMA.split(", ")]
PREVIOUS_SCHEMA = "amount decimal(18,2), event_time timestamp, event_id string"


def iceberg_jar() -> str:
    import snowpark_connect_deps_iceberg

    folder = os.path.join(os.path.dirname(snowpark_connect_deps_iceberg.__file__), "jars")
    return glob.glob(os.path.join(folder, "iceberg-spark-runtime-3.5_2.12-*.jar"))[0]


def session(home: str):
    from pyspark.sql import SparkSession

    # (the Python workers of ``live-keyed`` run this interpreter, as in a user's activated virtualenv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

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


def alerts(key, frames, state):
    """The keyed peer's function: a card's payments of a batch, its previous payment as the state."""
    from datetime import timedelta

    import pandas as pd

    day = timedelta(hours=24)
    previous = tuple(state.get) if state.exists else None
    out = []
    for pdf in frames:
        pdf = pdf.sort_values(["event_time", "event_id"])
        for user, event_id, t, amount in zip(pdf["user_id"], pdf["event_id"], pdf["event_time"], pdf["amount"]):
            t = t.to_pydatetime()
            if previous is not None and t - previous[1] <= day and amount > 10 * previous[0]:
                out.append((key[0], user, event_id, t, amount, previous[0], previous[1], previous[2],
                            float(amount / previous[0])))
            previous = (amount, t, event_id)
    if previous is not None:
        state.update(previous)
    yield pd.DataFrame(out, columns=ALERT_COLUMNS)


def keyed_stream(spark, landing: str, home: str):
    from pyspark.sql import functions as F
    from pyspark.sql.streaming.state import GroupStateTimeout

    spark.sql(f"CREATE TABLE IF NOT EXISTS {ALERTS} ({ALERT_SCHEMA}) USING iceberg")
    stream = (payments(spark.readStream.format("text").load(landing))
              .where(F.col("card_id").isNotNull() & F.col("amount").isNotNull())
              .select("card_id", "user_id", "event_id", "event_time", "amount")
              .withWatermark("event_time", "5 seconds"))
    out = stream.groupBy("card_id").applyInPandasWithState(alerts, ALERT_SCHEMA, PREVIOUS_SCHEMA, "append",
                                                           GroupStateTimeout.NoTimeout)
    return (out.writeStream.format("iceberg").outputMode("append")
            .option("checkpointLocation", os.path.join(home, "checkpoint")).toTable(ALERTS))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("stream", "batch", "live", "live-keyed"))
    parser.add_argument("--landing", required=True)
    parser.add_argument("--home", required=True)
    parser.add_argument("--max-files-per-trigger", type=int)
    args = parser.parse_args()
    spark = session(args.home)
    table = TABLE
    if args.mode == "batch":
        metrics(payments(spark.read.format("text").load(args.landing))).writeTo(TABLE).append()
    elif args.mode == "live-keyed":
        table = ALERTS
        _until_stopped(keyed_stream(spark, args.landing, args.home))
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
            _until_stopped(query)
        else:
            query.awaitTermination()
            _batches(query)
    rows = spark.table(table).count()
    print(f"DONE {rows} {time.time() - STARTED:.2f}", flush=True)
    return 0


def _until_stopped(query) -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while query.isActive and not stop.is_set():
        stop.wait(0.5)
    query.stop()
    _batches(query)


def _batches(query) -> None:
    for p in query.recentProgress:
        print(f"BATCH {p['batchId']} {p['numInputRows']} {p['durationMs'].get('triggerExecution', 0)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
