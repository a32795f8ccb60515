"""Keyed state on Spark's state store: event-time timers fire on the watermark, state survives a
restart and TTL removes it, processing-time timers fire on the batch clock.

Times are offsets from ``T0``; one file per micro-batch; the watermark is ``max event time - 10 s``
of the earlier batches (Spark starts at 0).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from pyspark.sql import functions as F

from streaming.declaration import KeyedJob, Table, Watermark
from streaming.keyed import (
    PROCESSING_TIME,
    KeyedProcessFunction,
    TtlConfig,
    ValueStateDescriptor,
)
from streaming.run.runner import run_stream
from streaming.jobs.sources import PAYMENTS
from tests.conftest import drop_job_tables
from tests.landing import MIN, SEC, T0, payment, write_batches

SINK = "lake.test.reminders"


class Reminder(KeyedProcessFunction):
    """Counts a user's payments (count kept 6 min of event time) and, 2 minutes after each one,
    reports the count and the watermark the timer fired under."""

    def open(self, ctx):
        self.count = ctx.get_state(ValueStateDescriptor("count", "long", ttl=TtlConfig(timedelta(minutes=6))))

    def process_element(self, value, ctx):
        self.count.update((self.count.value() or 0) + 1)
        ctx.timer_service().register_event_time_timer(ctx.timestamp() + 2 * MIN)

    def on_timer(self, timestamp_ms, ctx):
        yield (ctx.get_current_key()[0], timestamp_ms, self.count.value(), ctx.timer_service().current_watermark())


def cols(frame):
    return frame.select("user_id", "event_time", "event_id")


def reminder_job(function=Reminder, timers="event_time", dedup_ttl=timedelta(minutes=30)) -> KeyedJob:
    return KeyedJob(
        name="reminder_test", sources=(PAYMENTS,), keys=("user_id",),
        watermark=Watermark(timedelta(seconds=10)), transform=cols, function=function,
        output="user_id string, fired_at timestamp, count long, watermark_ms long", time_column="fired_at",
        sink=Table(SINK), history=timedelta(minutes=5), timers=timers, dedup_ttl=dedup_ttl,
    )


def p(i, offset, user):
    return payment(f"e{i}", T0 + offset, user=user)


def run(spark, settings, job, **kw):
    settings = settings.with_job(job.name, max_files_per_trigger=1)
    return run_stream(spark, settings, job, progress=None, install_signal_handlers=False, **kw)


def test_timers_fire_on_the_watermark_and_state_survives_a_restart(spark, lake):
    drop_job_tables(spark, namespaces=("test",))
    job = reminder_job()
    landing = lake.landing_dir("payments")
    #   b0: u1@00:00 u2@00:30                   W=0 (Spark's start)
    #   b1: u1@01:00 u3@05:00                   W=00:20 -> u1@00:00 delivered
    #   b2: u3@10:00                            W=04:50 -> u2@00:30, u1@01:00 delivered; timers u1 02:00,
    #                                                      u2 02:30, u1 03:00 fire
    #   end of input (no-data batch)            W=09:50 -> u3@05:00 delivered, its timer 07:00 fires
    #   --- the stream stops here and is started again ---
    #   b4: u1@03:00 (late: 03:00 <= 09:50)     W=09:50
    #       u3@20:00
    #   end of input (no-data batch)            W=19:50 -> u3@10:00 delivered, timer 12:00 fires (count 2)
    write_batches(landing, [[p(1, 0, "u1"), p(2, 30 * SEC, "u2")], [p(3, 1 * MIN, "u1"), p(4, 5 * MIN, "u3")],
                            [p(5, 10 * MIN, "u3")]])
    first = run(spark, lake, job, available_now=True)
    assert first.batches == 4  # three with data, then one that fires what the last watermark made due
    write_batches(landing, [[p(6, 3 * MIN, "u1"), p(7, 20 * MIN, "u3")]], start=3)
    second = run(spark, lake, job, available_now=True)

    rows = sorted(tuple(r) for r in spark.sql(
        f"SELECT user_id, unix_millis(fired_at) - {T0}, count, watermark_ms - {T0} FROM {SINK}").collect())
    W2, W3, W_END = 4 * MIN + 50 * SEC, 9 * MIN + 50 * SEC, 19 * MIN + 50 * SEC
    assert rows == [
        ("u1", 2 * MIN, 2, W2), ("u1", 3 * MIN, 2, W2), ("u2", 2 * MIN + 30 * SEC, 1, W2),
        ("u3", 7 * MIN, 1, W3), ("u3", 12 * MIN, 2, W_END),  # count 2: the 05:00 payment survived the restart
    ]
    late = spark.sql(f"SELECT event_id, user_id, watermark_ms - {T0} AS w, late_by_ms, source_file FROM {SINK}_late").collect()
    assert [(r.event_id, r.user_id, r.w, r.late_by_ms) for r in late] == [("e6", "u1", W3, W3 - 3 * MIN)]
    assert late[0].source_file.endswith("/batch-0003.jsonl")  # its file, although the transform selects columns
    assert second.totals.late == 1


def legacy_group_state(view) -> bytes:
    """A bucket's value in Spark's state store as lakestream kept it before the key files: every key's state."""
    import pickle

    rows = view.rows.items()
    return pickle.dumps({"s": {k: r[0] for k, r in rows}, "w": {k: r[1] for k, r in rows if r[1] is not None},
                         "p": {k: r[2] for k, r in rows if r[2] is not None}})


def test_buckets_kept_whole_in_sparks_state_move_to_key_files_and_the_stream_goes_on(spark, lake, monkeypatch):
    """A checkpoint of the earlier version holds each bucket's keys whole in Spark's state store: resumed, each
    bucket's keys move to key files as the bucket is next run, and no state is lost (as in the first test)."""
    import json
    import shutil
    from pathlib import Path

    from streaming.checkpoint.layout import Layout
    from streaming.run import keyed as keyed_run
    from streaming.spark import keyed as keyed_spark

    drop_job_tables(spark, namespaces=("test",))
    job = reminder_job()
    landing = lake.landing_dir("payments")
    layout = Layout(lake.checkpoint_dir(job.name))
    write_batches(landing, [[p(1, 0, "u1"), p(2, 30 * SEC, "u2")], [p(3, 1 * MIN, "u1"), p(4, 5 * MIN, "u3")],
                            [p(5, 10 * MIN, "u3")]])
    monkeypatch.setattr(keyed_spark, "group_state", legacy_group_state)
    monkeypatch.setattr(keyed_run, "KEY_DELTAS_FORMAT", 3)  # (the earlier version's records)
    run(spark, lake, job, available_now=True)
    monkeypatch.undo()
    shutil.rmtree(layout.keys)  # the earlier version had no key files: the state is in Spark's store alone
    write_batches(landing, [[p(6, 3 * MIN, "u1"), p(7, 20 * MIN, "u3")]], start=3)
    run(spark, lake, job, available_now=True)

    rows = sorted(tuple(r) for r in spark.sql(f"SELECT user_id, unix_millis(fired_at) - {T0}, count FROM {SINK}").collect())
    assert rows == [("u1", 2 * MIN, 2), ("u1", 3 * MIN, 2), ("u2", 2 * MIN + 30 * SEC, 1), ("u3", 7 * MIN, 1),
                    ("u3", 12 * MIN, 2)]  # count 2: the 05:00 payment, kept whole, survived the move
    latest = json.loads(max(Path(layout.batches).glob("*.json"), key=lambda f: int(f.stem)).read_text())
    assert latest["format"] == 7  # an earlier version now refuses the checkpoint instead of finding no state (or ids)
    assert list(Path(layout.keys).rglob("*.parquet"))


def test_a_checkpoint_of_the_earlier_layout_resumes_with_its_64_key_buckets(spark, lake, monkeypatch):
    """Checkpoints written before the bucket count was recorded used 64 buckets: resumed with another
    count, a key's state would sit in a group the key no longer hashes to, and be lost silently."""
    import json
    from pathlib import Path

    from streaming.spark import keyed as keyed_spark
    from streaming.checkpoint.layout import Layout

    drop_job_tables(spark, namespaces=("test",))
    job = reminder_job()
    partitions = int(spark.conf.get("spark.sql.shuffle.partitions"))
    u3_of_64 = spark.range(1).select(F.pmod(F.xxhash64(F.lit("u3")), F.lit(64))).first()[0]
    assert u3_of_64 >= keyed_spark.BUCKETS_PER_PARTITION * partitions, "u3 must change group with the count"
    landing = lake.landing_dir("payments")
    write_batches(landing, [[p(1, 0, "u1"), p(2, 30 * SEC, "u2")], [p(3, 1 * MIN, "u1"), p(4, 5 * MIN, "u3")],
                            [p(5, 10 * MIN, "u3")]])
    monkeypatch.setattr(keyed_spark, "BUCKETS_PER_PARTITION", 64 // partitions)  # as the earlier version did
    monkeypatch.setattr(keyed_spark, "bucket_labels", lambda *args: None)  # (buckets grouped by their number)
    run(spark, lake, job, available_now=True)
    monkeypatch.undo()
    records = Path(Layout(lake.checkpoint_dir(job.name)).batches)
    for path in records.glob("*.json"):  # the earlier version's records: no bucket count, no labels
        data = json.loads(path.read_text())
        assert data.pop("key_buckets") == 64
        assert "bucket_labels" not in data
        path.write_text(json.dumps(data))
    # u3@14:00 counts the payments of 05:00 and 10:00 (kept 6 min) from before the restart: its timer's
    # row says 3, or 1 if its state was not found; u1@40:00 moves the watermark past that timer
    write_batches(landing, [[p(6, 3 * MIN, "u1"), p(7, 14 * MIN, "u3")], [p(8, 40 * MIN, "u1")]], start=3)
    run(spark, lake, job, available_now=True)

    rows = sorted(tuple(r) for r in spark.sql(f"SELECT user_id, count FROM {SINK} WHERE user_id = 'u3'").collect())
    assert rows == [("u3", 1), ("u3", 2), ("u3", 3)]
    latest = json.loads(max(records.glob("*.json"), key=lambda f: int(f.stem)).read_text())
    assert latest["key_buckets"] == 64
    assert "bucket_labels" not in latest  # the earlier grouping is kept for the checkpoint's life


def test_a_new_keyed_stream_spreads_its_buckets_evenly_over_the_shuffle_partitions(spark):
    """Bucket numbers 0..15 hash 3, 3, 4 and 6 to four partitions; a new stream's bucket labels put the
    same number in each (checked with Spark's own hash partitioning, as the state function's shuffle does)."""
    from streaming.spark import keyed as keyed_spark

    for partitions, buckets in ((2, 8), (4, 16), (3, 12), (4, keyed_spark.BOUNDED_KEY_BUCKETS), (5, 64), (1, 4)):
        labels = keyed_spark.bucket_labels(None, buckets, partitions)
        assert len(set(labels)) == buckets
        frame = spark.createDataFrame([(i, v) for i, v in enumerate(labels)], "i int, v int")
        placed = frame.repartition(partitions, "v").select("i", F.spark_partition_id().alias("p")).collect()
        per_partition = {}
        for row in placed:
            per_partition.setdefault(row.p, []).append(row.i)
        assert {row.i: row.p for row in placed} == {i: i % partitions for i in range(buckets)}
        assert sorted(len(v) for v in per_partition.values()) == sorted(
            len(range(p, buckets, partitions)) for p in range(partitions))


def test_the_python_int_hash_is_sparks(spark):
    """The labels are computed without a Spark job, by Spark's Murmur3 hash of an int redone in Python: checked
    against Spark's own ``hash`` over random ints, the edges included."""
    import random

    from streaming.spark import keyed as keyed_spark

    rng = random.Random(7)
    values = [0, 1, -1, 2**31 - 1, -2**31, *[rng.randrange(-2**31, 2**31) for _ in range(2_000)]]
    rows = spark.createDataFrame([(v,) for v in values], "v int").select("v", F.hash("v").alias("h")).collect()
    assert {r.v: r.h for r in rows} == {v: keyed_spark._spark_int_hash(v) for v in values}


def test_the_functions_decimals_reach_spark_rounded_to_the_scale_whatever_python_number_they_are(spark):
    """A bounded twin's decimal output column crosses to Spark as an Arrow column when its values fit the type
    as they are, else rounded half-even to the scale (more digits, floats): both ways against Python's own
    ``quantize``, through PySpark's grouped map as the bounded twin's output goes. (A stream's columns stay
    objects: its frames are concatenated; the keyed jobs' stream tests cover that way.)"""
    import random
    from collections import Counter
    from decimal import ROUND_HALF_EVEN, Decimal

    import pandas as pd
    from pyspark.sql import types as T

    from streaming.spark.keyed import _column

    rng = random.Random(11)
    fitting = [None, 0, -3, Decimal("-0.00"), Decimal("12.3"), Decimal("9999999999999999.99"),
               *[Decimal(rng.randrange(-10**9, 10**9)).scaleb(-rng.randrange(0, 3)) for _ in range(300)]]
    rounded = [Decimal("1.005"), Decimal("1.015"), Decimal("-2.675"), 2.5, 0.1,
               *[Decimal(rng.randrange(-10**9, 10**9)).scaleb(-rng.randrange(3, 6)) for _ in range(300)]]
    dtype = T.DecimalType(18, 2)
    assert isinstance(_column(fitting, dtype, arrow=True).dtype, pd.ArrowDtype)  # (the fast way is the one taken)
    assert _column(fitting, dtype).dtype == object  # (a stateful map's frames are concatenated: objects)
    cases = [fitting, rounded, fitting + rounded]

    def column(pdf):
        return pd.DataFrame({"case": pdf["case"].iloc[:1].repeat(len(cases[pdf["case"].iloc[0]])).tolist(),
                             "d": _column(cases[pdf["case"].iloc[0]], dtype, arrow=True)})

    got = (spark.createDataFrame([(i,) for i in range(len(cases))], "case int")
           .groupBy("case").applyInPandas(column, "case int, d decimal(18,2)").collect())
    quantum = Decimal("0.01")
    for i, values in enumerate(cases):
        expected = [None if v is None else Decimal(v).quantize(quantum, rounding=ROUND_HALF_EVEN) for v in values]
        assert Counter(r.d for r in got if r.case == i) == Counter(expected)  # (-0.00 is 0.00 in Spark too)


def test_a_keyed_streams_batch_after_a_small_one_runs_interpreted_and_after_a_large_one_compiled(spark):
    """The next batch's stages run without generated code after a batch of at most INTERPRETED_BATCH_LINES lines, in
    the stream's own session, until a larger batch puts the session's setting back (the results of such batches are
    the other tests' oracles: their batches after the first are small)."""
    from streaming.run.keyed import NEXT_INTERPRETED, KeyedHandler

    session = spark.newSession()
    (key, value), = NEXT_INTERPRETED.items()
    session.conf.set(key, "true")
    handler = KeyedHandler.__new__(KeyedHandler)  # (only its setting of the next plan)
    handler._compiled = None
    for interpreted, expected in ((True, value), (True, value), (False, "true"), (False, "true"), (True, value)):
        handler._plan_next(session, interpreted=interpreted)
        assert session.conf.get(key) == expected
    assert spark.conf.get(key) != value  # another session's setting is its own


def test_ttl_and_fired_timers_leave_no_state_behind(spark, lake):
    drop_job_tables(spark, namespaces=("test",))
    job = reminder_job(dedup_ttl=timedelta(minutes=1))  # ids are remembered (for dedup) one minute only
    # 30 users pay once each in the first minute; then only u0 keeps paying for 20 minutes.
    batches = [[p(i, i * SEC, f"u{i}") for i in range(30)]]
    batches += [[p(100 + m, m * MIN, "u0")] for m in range(2, 22, 4)]
    write_batches(lake.landing_dir("payments"), batches)
    from streaming.run.runner import start_stream

    settings = lake.with_job(job.name, max_files_per_trigger=1)
    query, report = start_stream(spark, settings, job, available_now=True)
    query.awaitTermination()
    assert query.exception() is None
    operators = query.lastProgress["stateOperators"]
    # each user's count expired 6 minutes after its payment, its timer fired and its id was
    # forgotten: only u0, still paying, has state (its count, the payment not yet released, timers)
    assert operators[0]["numRowsTotal"] == 1
    fired = spark.table(SINK).where(F.col("user_id") != "u0").count()
    assert fired == 29  # every other user's reminder fired once


class ProcessingReminder(KeyedProcessFunction):
    """Reports 1.5 s of processing time after each payment."""

    def process_element(self, value, ctx):
        now = ctx.timer_service().current_processing_time()
        ctx.timer_service().register_processing_time_timer(now + 1500)

    def on_timer(self, timestamp_ms, ctx):
        yield (ctx.get_current_key()[0], timestamp_ms, 0, ctx.timer_service().current_processing_time())


def test_processing_time_timers_fire_on_the_batch_clock_without_new_input(spark, lake):
    drop_job_tables(spark, namespaces=("test",))
    job = reminder_job(ProcessingReminder, timers=PROCESSING_TIME)
    write_batches(lake.landing_dir("payments"), [[p(1, 0, "u1")], [p(2, 2 * MIN, "u1")]])
    stop, reports, errors = threading.Event(), [], []
    settings = lake.with_job(job.name, trigger_interval=timedelta(milliseconds=500))

    def stream():
        try:
            reports.append(run(spark, settings, job, available_now=False, stop_event=stop))
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(exc)

    started = int(time.time() * 1000)
    runner = threading.Thread(target=stream, daemon=True)
    runner.start()
    deadline = time.monotonic() + 90
    rows = []
    while time.monotonic() < deadline and not errors:
        if spark.catalog.tableExists(SINK):
            rows = spark.sql(f"SELECT unix_millis(fired_at) AS ts, watermark_ms AS now FROM {SINK}").collect()
            if len(rows) >= 1:
                break
        time.sleep(1)
    stop.set()
    runner.join(timeout=60)
    assert not errors, errors
    assert rows, "the processing-time timer fired while no new input arrived"
    ts, now = rows[0].ts, rows[0].now
    assert ts >= started + 1500 and now >= ts  # fired at the first batch whose clock reached it
    assert reports and reports[0].batches >= 2  # the element's batch, then a later one for the timer


def test_a_new_keyed_stream_on_a_local_master_takes_no_more_partitions_than_cores_and_keeps_them(spark, lake):
    """Configured with more shuffle partitions than the machine has cores, a new keyed stream starts with
    one per core (the offset log records it, the session keeps its setting) and resumes with it."""
    from streaming.checkpoint.compat import stored_shuffle_partitions
    from streaming.spark.hadoopfs import HadoopFS

    drop_job_tables(spark, namespaces=("test",))
    job = reminder_job()
    cores = spark.sparkContext.defaultParallelism
    landing = lake.landing_dir("payments")
    write_batches(landing, [[p(1, 0, "u1"), p(2, 30 * SEC, "u2")], [p(3, 1 * MIN, "u1"), p(4, 5 * MIN, "u3")]])
    configured = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.shuffle.partitions", str(cores + 2))
    try:
        run(spark, lake, job, available_now=True)
        assert spark.conf.get("spark.sql.shuffle.partitions") == str(cores + 2)
        assert stored_shuffle_partitions(HadoopFS(spark), lake.checkpoint_dir(job.name)) == cores
        write_batches(landing, [[p(5, 10 * MIN, "u3")], [p(6, 40 * MIN, "u1")]], start=2)
        run(spark, lake, job, available_now=True)  # (resumed, not refused as "partitions changed")
        assert stored_shuffle_partitions(HadoopFS(spark), lake.checkpoint_dir(job.name)) == cores
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", configured)
    # the oracle: a timer 2 minutes after each payment reports the count then (payments delivered in
    # event-time order, a count kept 6 minutes): u1 pays at 00:00 and 01:00 (both timers see 2), u2 at
    # 00:30, u3 at 05:00 (its 07:00 timer sees 1) and 10:00 (12:00 sees 2); u1@40:00 passes them all
    rows = sorted(tuple(r) for r in spark.sql(f"SELECT user_id, count FROM {SINK}").collect())
    assert rows == [("u1", 2), ("u1", 2), ("u2", 1), ("u3", 1), ("u3", 2)]
