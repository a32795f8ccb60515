"""What the benchmarks share: payment files written at a chosen size and pace, the plain-Spark peer
query, and latency read from outside the query (file appearance vs the checkpoint's commit log).

The peer is the query a Spark user writes instead of lakestream: text file source, ``from_json``,
``withWatermark`` 5 s, a 5-minute tumbling window per user, Iceberg append. It drops late and bad
records silently; lakestream validates, quarantines, dedups, keeps a late side output and commits
exactly once, all of it timed here.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyspark.sql import functions as F  # noqa: E402

from streaming.checkpoint.layout import Layout, log_lines, numbered, source_log_entries, source_log_files  # noqa: E402
from streaming.io.parse import AMOUNT_TYPE  # noqa: E402

PLAIN_TABLE = "lake.bench.plain_purchase_metrics"
SCHEMA = (
    "event_id string, event_time timestamp, card_id string, user_id string, merchant_id string, "
    f"amount decimal({AMOUNT_TYPE.precision},{AMOUNT_TYPE.scale}), currency string, status string"
)
_STATUS = ("APPROVED", "APPROVED", "APPROVED", "DECLINED")
_CURRENCY = ("EUR", "USD", "GBP")


class Payments:
    """Payment lines: ``users`` users with 3 cards each, event times spread over [start, end) ms.
    About 1 % of lines repeat an earlier event (a duplicate delivery) and 0.2 % are malformed, so
    the dedup and quarantine paths carry real work."""

    def __init__(self, users: int = 2000, seed: int = 7):
        self.users = users
        self.seq = 0
        self.seed = seed

    def lines(self, n: int, start_ms: int, end_ms: int) -> list[str]:
        out = []
        span = max(1, end_ms - start_ms)
        for i in range(n):
            self.seq += 1
            k = self.seq * 2654435761 + self.seed
            if k % 500 == 0:
                out.append('{"event_id": "broken-%d", "event_time": ' % self.seq)
                continue
            seq = self.seq - 50 if k % 100 == 1 and self.seq > 50 else self.seq
            t = start_ms + (i * span) // n
            user = (k >> 7) % self.users
            out.append(json.dumps({
                "event_id": f"e{self.seed}-{seq}", "event_time": _iso(t), "card_id": f"c{user}-{k % 3}",
                "user_id": f"u{user}", "merchant_id": f"m{(k >> 3) % 500}",
                "amount": f"{(k % 20000) / 100 + 1:.2f}", "currency": _CURRENCY[k % 3], "status": _STATUS[(k >> 5) % 4],
            }, separators=(",", ":")))
        return out


def _iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z"


def write_file(folder: Path, name: str, lines: list[str]) -> float:
    """Write atomically (hidden name, then rename): a stream never sees half a file. Returns the
    wall-clock time the file appeared."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{name}.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, folder / name)
    return time.time()


def fresh_plain_table(spark, checkpoint: str) -> None:
    spark.sql("CREATE NAMESPACE IF NOT EXISTS lake.bench")
    spark.sql(f"DROP TABLE IF EXISTS {PLAIN_TABLE} PURGE")
    spark.sql(
        f"CREATE TABLE {PLAIN_TABLE} (user_id string, window_start timestamp, window_end timestamp, event_count bigint, "
        "approved_count bigint, declined_count bigint, amount_sum decimal(38,2)) USING iceberg "
        "PARTITIONED BY (days(window_start))"
    )
    shutil.rmtree(checkpoint, ignore_errors=True)


def plain_metrics(frame):
    """The peer's aggregation over typed payments (stream or batch)."""
    return (
        frame.groupBy("user_id", F.window("event_time", "5 minutes"))
        .agg(
            F.count(F.lit(1)).alias("event_count"),
            F.sum((F.col("status") == "APPROVED").cast("long")).alias("approved_count"),
            F.sum((F.col("status") == "DECLINED").cast("long")).alias("declined_count"),
            F.sum("amount").cast("decimal(38,2)").alias("amount_sum"),
        )
        .select("user_id", F.col("window.start").alias("window_start"), F.col("window.end").alias("window_end"),
                "event_count", "approved_count", "declined_count", "amount_sum")
    )


def parsed(text_frame):
    return text_frame.select(F.from_json("value", SCHEMA).alias("p")).select("p.*").where(F.col("event_time").isNotNull())


def start_plain(spark, landing: str, checkpoint: str, *, files_per_trigger: int | None = None,
                available_now: bool = False, trigger_seconds: float = 0.0):
    """The peer as a stream: text source, from_json, withWatermark 5 s, window, Iceberg append."""
    fresh_plain_table(spark, checkpoint)
    reader = spark.readStream.format("text")
    if files_per_trigger:
        reader = reader.option("maxFilesPerTrigger", files_per_trigger)
    payments = parsed(reader.load(landing)).withWatermark("event_time", "5 seconds")
    writer = (plain_metrics(payments).writeStream.format("iceberg").outputMode("append")
              .option("checkpointLocation", checkpoint))
    writer = writer.trigger(availableNow=True) if available_now else writer.trigger(processingTime=f"{trigger_seconds} seconds")
    return writer.toTable(PLAIN_TABLE)


def run_plain_bounded(spark, landing: str) -> int:
    """The peer as a batch: spark.read + the same aggregate + Iceberg append."""
    spark.sql("CREATE NAMESPACE IF NOT EXISTS lake.bench")
    spark.sql(f"DROP TABLE IF EXISTS {PLAIN_TABLE} PURGE")
    frame = plain_metrics(parsed(spark.read.format("text").load(landing)))
    frame.writeTo(PLAIN_TABLE).using("iceberg").partitionedBy(F.days("window_start")).create()
    return spark.table(PLAIN_TABLE).count()


# -- latency from outside the query ---------------------------------------------------------------

@dataclass(frozen=True)
class Latency:
    samples: list[float]  # seconds from a file's appearance to the commit of the batch that read it
    batches: int
    batch_seconds: list[float]  # commit-to-commit intervals

    def pct(self, p: float) -> float:
        s = sorted(self.samples)
        return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] if s else float("nan")

    def line(self) -> str:
        med = statistics.median(self.batch_seconds) if self.batch_seconds else float("nan")
        return (f"p50 {self.pct(50):5.2f} s  p99 {self.pct(99):5.2f} s  over {len(self.samples)} files, "
                f"{self.batches} batches (median {med:.2f} s apart)")


def latency(checkpoint: str, appeared: dict[str, float], since: float) -> Latency:
    """Per landing file that appeared after ``since``: the commit-log file's mtime of the batch whose
    source log lists it, minus the time the file appeared. Files not committed yet are left out."""
    layout = Layout(checkpoint)
    commits = {b: os.stat(layout.commit(b)).st_mtime for b in numbered(os.listdir(layout.commits))}
    read_in: dict[str, int] = {}
    src = f"{layout.sources}/0"
    for name in source_log_files(os.listdir(src)):
        text = Path(src, name).read_text()
        for entry in source_log_entries(text, name, int(name.split(".")[0])):
            read_in[os.path.basename(entry.path)] = entry.batch_id
    samples, batches = [], set()
    for name, at in appeared.items():
        b = read_in.get(name)
        if at < since or b is None or b not in commits:
            continue
        samples.append(commits[b] - at)
        batches.add(b)
    times = sorted(commits[b] for b in batches)
    return Latency(samples, len(batches), [b - a for a, b in zip(times, times[1:])])

