"""The aggregates people expect (avg, count_distinct exact and approximate, first/last by event time,
percentile), as a stream over random input split into random micro-batches (corrections within allowed
lateness, the late side output, sessions that merge), as the bounded twin, and reconciled — each against
plain Python over the same events; the sketches' stated errors on many values."""

from __future__ import annotations

import math
import random
from datetime import timedelta
from decimal import ROUND_HALF_UP, Decimal

import pytest
from pyspark.sql import functions as F

from batch.backfill import backfill
from batch.reconcile import reconcile
from streaming.declaration import Agg, DeclarationError, Table, Watermark, WindowedJob
from streaming.jobs.sources import PAYMENTS
from streaming.run.runner import run_stream
from streaming.time import from_epoch_ms
from streaming.windows import Session, Sliding, Tumbling
from tests.conftest import drop_job_tables
from tests.landing import MIN, SEC, T0, iso, with_t, write_batches
from tests.oracle_windows import Win, bounded_windows, replay_windows, win_of

SINK = "lake.test.aggregates"
DELAY = 10 * SEC
AGGREGATES = (
    Agg.count("events"),
    Agg.avg("amount", "avg_amount"),
    Agg.count_distinct("merchant_id", "merchants"),
    Agg.count_distinct("card_id", "cards", approximate=True),
    Agg.first("merchant_id", "first_merchant"),
    Agg.last("amount", "last_amount"),
    Agg.percentile("amount", 0.5, "p50"),
    Agg.percentile("amount", 0.9, "p90"),
)
EXACT = ("events", "avg_amount", "merchants", "first_merchant", "last_amount")


def columns(frame):
    return frame.select("user_id", "event_time", "event_id", "merchant_id", "card_id", "amount")


def job_for(window, lateness: timedelta) -> WindowedJob:
    return WindowedJob(name="aggregates_test", sources=(PAYMENTS,), keys=("user_id",), window=window,
                       watermark=Watermark(timedelta(milliseconds=DELAY), allowed_lateness=lateness), transform=columns,
                       aggregates=AGGREGATES, sink=Table(SINK))


def measure(events: list[dict]) -> dict:
    """Plain Python: the aggregates' definitions (percentile: the value at rank ceil(q * n))."""
    amounts = [Decimal(e["amount"]) for e in events]
    n = len(events)
    ordered = sorted(events, key=lambda e: (e["t_ms"], e["event_id"]))
    values = sorted(amounts)

    def rank(q: float) -> float:
        return float(values[max(1, math.ceil(q * n - 1e-9)) - 1])

    return {"events": n, "avg_amount": (sum(amounts) / n).quantize(Decimal("0.000001"), ROUND_HALF_UP),
            "merchants": len({e["merchant_id"] for e in events}), "cards": len({e["card_id"] for e in events}),
            "first_merchant": ordered[0]["merchant_id"], "last_amount": Decimal(ordered[-1]["amount"]),
            "p50": rank(0.5), "p90": rank(0.9)}


def agree(got: dict, want: dict) -> bool:
    """Exact aggregates equal; the approximate ones within their stated errors."""
    if any(got[k] != want[k] for k in EXACT):
        return False
    if abs(got["cards"] - want["cards"]) > max(1, 0.05 * want["cards"]):
        return False
    return all(abs(got[p] - want[p]) <= 0.01 * abs(want[p]) + 1e-9 for p in ("p50", "p90"))


def read_table(spark, table: str = SINK) -> dict:
    out = {}
    for r in spark.sql(f"SELECT *, unix_millis(window_start) AS ws FROM {table}").collect():
        key = (r.user_id, r.ws)
        assert key not in out, f"duplicate window {key}"
        out[key] = {"events": r.events, "avg_amount": r.avg_amount, "merchants": r.merchants, "cards": r.cards,
                    "first_merchant": r.first_merchant, "last_amount": r.last_amount, "p50": r.p50, "p90": r.p90}
    return out


def scenario(seed: int) -> list[list[dict]]:
    """Random payments of a few users over ~10 minutes, out of order, some minutes late, some delivered
    twice, split into random micro-batches (lists in arrival order)."""
    rng = random.Random(seed)
    events = []
    for i in range(rng.randint(90, 160)):
        t = T0 + rng.randint(0, 10 * MIN)
        user = f"u{rng.randint(1, 4)}"
        delay = rng.randint(0, 15 * SEC) if rng.random() > 0.08 else rng.randint(2 * MIN, 5 * MIN)
        events.append((t + delay, {
            "event_id": f"e{i}", "event_time": iso(t), "card_id": f"c{user}-{rng.randint(0, 5)}", "user_id": user,
            "merchant_id": f"m{rng.randint(1, 6)}", "amount": f"{rng.choice([1, 5, 9.5, 12.25, 40, 99.99, 250])}",
            "currency": "EUR", "status": "APPROVED"}))
    for _, e in rng.sample(events, 6):  # re-delivered, the same line, later
        events.append((_arrival_of(events, e) + rng.randint(1, 30 * SEC), dict(e)))
    events.sort(key=lambda x: x[0])
    lines = [e for _, e in events]
    cuts = sorted(rng.sample(range(1, len(lines)), rng.randint(3, 6)))
    return [lines[a:b] for a, b in zip([0, *cuts], [*cuts, len(lines)])]


def _arrival_of(events, e):
    return next(a for a, x in events if x is e)


def disagreements(got: dict, want: dict) -> list:
    wrong = [k for k in want if k in got and not agree(got[k], want[k])]
    return sorted(set(got) ^ set(want)) + wrong


@pytest.mark.parametrize("window, lateness, seed", [
    (Tumbling(size=timedelta(minutes=1)), timedelta(seconds=30), 1),
    (Sliding(size=timedelta(minutes=2), every=timedelta(minutes=1)), timedelta(0), 2),
    (Session(gap=timedelta(seconds=40)), timedelta(seconds=20), 3),
], ids=["tumbling-with-lateness", "sliding", "session-with-lateness"])
def test_the_new_aggregates_as_a_stream_its_twin_and_reconciled_equal_plain_python(spark, lake, window, lateness, seed):
    drop_job_tables(spark, namespaces=("test",))
    job = job_for(window, lateness)
    batches = scenario(seed)
    write_batches(lake.landing_dir("payments"), batches)
    settings = lake.with_job(job.name, max_files_per_trigger=1)
    run_stream(spark, settings, job, available_now=True, progress=None, install_signal_handlers=False)

    truth = replay_windows([with_t(b) for b in batches], win_of(window), delay=DELAY, lateness=job.watermark.allowed_lateness_ms,
                           key=lambda e: e["user_id"], measure=measure)
    want = {k: v for k, v in truth.table.items()}
    assert not disagreements(read_table(spark), want), disagreements(read_table(spark), want)
    late = sorted((r.event_id, r.user_id) for r in spark.table(f"{SINK}_late").collect())
    assert late == sorted((i, k) for i, k, _, _ in truth.late)

    lo, hi = from_epoch_ms(T0 - 30 * MIN), from_epoch_ms(T0 + 60 * MIN)
    assert reconcile(spark, settings, job, lo, hi, progress=None).unexplained == 0
    backfill(spark, settings, job, lo, hi, progress=None, force=True)
    twin = bounded_windows(with_t(sum(batches, [])), win_of(window), key=lambda e: e["user_id"], measure=measure)
    assert not disagreements(read_table(spark), twin), disagreements(read_table(spark), twin)


@pytest.mark.parametrize("by_driver", [True, False], ids=["pieces-written-by-the-driver", "pieces-written-by-spark"])
def test_a_batch_pieces_written_by_the_driver_or_by_spark_make_the_same_windows_as_plain_python(spark, lake, monkeypatch,
                                                                                             by_driver):
    """A tumbling stream's pieces (every aggregate's partial state: sums, exact sets, the sketches' bytes) are written
    from the driver when a batch has at most ``COLLECTED_ROWS`` of them, else by a Spark job (the limit set to 0:
    every batch overflows and falls back). Read back by later batches, both must fire the windows plain Python
    computes, and each batch's files must come from the path asked for."""
    import streaming.checkpoint.store as store_module
    from streaming.checkpoint.layout import Layout

    if not by_driver:
        monkeypatch.setattr(store_module, "COLLECTED_ROWS", 0)
    drop_job_tables(spark, namespaces=("test",))
    job = job_for(Tumbling(size=timedelta(minutes=1)), timedelta(seconds=30))
    batches = scenario(11)
    write_batches(lake.landing_dir("payments"), batches)
    settings = lake.with_job(job.name, max_files_per_trigger=1)
    run_stream(spark, settings, job, available_now=True, progress=None, install_signal_handlers=False)

    truth = replay_windows([with_t(b) for b in batches], win_of(job.window), delay=DELAY,
                           lateness=job.watermark.allowed_lateness_ms, key=lambda e: e["user_id"], measure=measure)
    assert not disagreements(read_table(spark), truth.table), disagreements(read_table(spark), truth.table)
    store = Layout(lake.checkpoint_dir(job.name)).store.removeprefix("file:")
    import glob

    parts = glob.glob(f"{store}/[0-9]*/pieces/*.parquet")
    assert parts, "the batches kept pieces"
    by_spark = [p for p in parts if p.endswith("-c000.zstd.parquet")]  # (Spark's names; the driver's have none)
    assert len(by_spark) == (0 if by_driver else len(parts)), parts


def test_the_sketches_keep_their_stated_errors_over_many_values_however_the_pieces_split(spark):
    """50,000 distinct cards and amounts over one window, cut into pieces at random and merged again:
    approx_count_distinct within 5 % (three standard errors of 1.6 %), every percentile within 1 %."""
    from streaming.io.schemas import types_of
    from streaming.windowed.aggregates import Aggregates

    job = WindowedJob(name="sketch_test", sources=(PAYMENTS,), keys=("user_id",), window=Tumbling(size=timedelta(hours=1)),
                      watermark=Watermark(timedelta(seconds=5)), transform=columns, sink=Table("lake.test.sketch"),
                      aggregates=(Agg.count_distinct("card_id", "cards", approximate=True),
                                  *[Agg.percentile("amount", q, f"p{int(q * 1000)}") for q in (0.001, 0.25, 0.5, 0.9, 0.999, 1.0)]))
    rng = random.Random(5)
    n = 50_000
    amounts = [Decimal(rng.randint(1, 10**6)) / 100 * (1 if rng.random() > 0.1 else -1) for _ in range(n)]
    rows = [("u1", T0 + i, f"e{i}", "m1", f"card-{i}", amounts[i], i % 7) for i in range(n)]
    frame = spark.createDataFrame(rows, "user_id string, t long, event_id string, merchant_id string, card_id string, "
                                        "amount decimal(18,2), piece int")
    frame = frame.withColumn("event_time", F.timestamp_millis("t")).withColumn("ws", F.lit(T0)).withColumn("we", F.lit(T0 + 3600_000))
    aggregates = Aggregates(job, types_of(job, frame.schema))
    pieces = frame.select("user_id", "ws", "we", "piece", *aggregates.event_columns()).groupBy("piece", "user_id", "ws", "we") \
        .agg(*aggregates.combine()).drop("piece")
    row = aggregates.finalized(aggregates.merge(pieces)).collect()[0]
    assert abs(row.cards - n) <= 0.05 * n, row.cards
    ordered = sorted(amounts)
    for q in (0.001, 0.25, 0.5, 0.9, 0.999, 1.0):
        exact = float(ordered[max(1, math.ceil(q * n - 1e-9)) - 1])
        assert abs(row[f"p{int(q * 1000)}"] - exact) <= 0.01 * abs(exact), (q, row[f"p{int(q * 1000)}"], exact)


def test_aggregates_refuse_what_they_cannot_compute():
    with pytest.raises(DeclarationError, match=r"q must be a number in \(0, 1\]"):
        Agg.percentile("amount", 95)
    with pytest.raises(DeclarationError, match="needs a column"):
        Agg("avg", "*")
    with pytest.raises(DeclarationError, match="must be one of sum, min, max, count, avg"):
        Agg("median", "amount")
    assert Agg.sum("amount").describe() == ["sum", "amount", "amount"]  # (a checkpoint's shape of a job is unchanged)
