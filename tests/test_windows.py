"""Tumbling, sliding and session windows with allowed lateness, on real streams and Iceberg tables.

Each scenario writes one file per micro-batch (so batch boundaries, and with them the watermark,
are deterministic), streams it, and compares the table and the late side output with the
independent oracle in ``oracle_windows`` replaying the same batches. Times are offsets from
``T0``; the watermark is ``max event time - 10 s``.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batch.backfill import backfill
from streaming.declaration import Agg, Table, Watermark, WindowedJob
from streaming.time import from_epoch_ms
from streaming.run.runner import run_stream
from streaming.jobs.sources import PAYMENTS
from streaming.windows import Session, Sliding, Tumbling
from tests.conftest import drop_job_tables
from tests.landing import MIN, SEC, T0, payment, with_t, write_batches
from tests.oracle_windows import Win, bounded_windows, replay_windows, win_of

DELAY = 10 * SEC
SINK = "lake.test.windows"


def amounts(frame):
    return frame.select("user_id", "event_time", "event_id", "amount")


def job_for(window, lateness: timedelta) -> WindowedJob:
    return WindowedJob(
        name="window_test", sources=(PAYMENTS,), keys=("user_id",), window=window,
        watermark=Watermark(timedelta(milliseconds=DELAY), allowed_lateness=lateness), transform=amounts,
        aggregates=(Agg.count("events"), Agg.sum("amount", "amount")), sink=Table(SINK),
    )


def measure(events):
    return {"events": len(events), "amount": sum((Decimal(str(e["amount"])) for e in events), Decimal("0"))}


def stream(spark, settings, job, batches):
    write_batches(settings.landing_dir("payments"), batches)
    settings = settings.with_job(job.name, max_files_per_trigger=1)
    report = run_stream(spark, settings, job, available_now=True, progress=None, install_signal_handlers=False)
    return report, read_windows(spark), read_late(spark)


def read_windows(spark) -> dict:
    rows = spark.sql(f"SELECT user_id, unix_millis(window_start) ws, unix_millis(window_end) we, events, amount FROM {SINK}").collect()
    out = {}
    for r in rows:
        assert (r.user_id, r.ws) not in out, f"duplicate window {(r.user_id, r.ws)}"
        out[(r.user_id, r.ws)] = (r.we, r.events, Decimal(r.amount))
    return out


def read_late(spark) -> list[tuple]:
    return sorted(
        (r.event_id, r.user_id, r.ws, r.we)
        for r in spark.sql(f"SELECT event_id, user_id, unix_millis(window_start) ws, unix_millis(window_end) we "
                           f"FROM {SINK}_late").collect()
    )


def expected(truth) -> dict:
    return {k: (v["window_end"], v["events"], v["amount"]) for k, v in truth.table.items()}


def oracle_run(job, batches):
    return replay_windows([with_t(b) for b in batches], win_of(job.window), delay=DELAY,
                          lateness=job.watermark.allowed_lateness_ms, key=lambda e: e["user_id"], measure=measure)


@pytest.fixture
def lake_home(lake, spark):
    drop_job_tables(spark, namespaces=("test",))
    return lake


def p(i, offset, user="u1", amount="10.00"):
    return payment(f"e{i}", T0 + offset, user=user, amount=amount)


def test_tumbling_window_fires_on_the_watermark_is_corrected_within_lateness_then_sends_late_aside(spark, lake_home):
    #   5-minute windows, allowed lateness 2 min:
    #   [00:00 ------------------ 05:00) [05:00 ------------------ 10:00)
    #   b0: u1@00:30 u1@04:50 u2@01:00                      W=04:40
    #   b1: u1@05:20 u2@06:00                               W=05:50 -> [00:00,05:00) fires (u1: 2, u2: 1)
    #   b2: u1@03:00 (within lateness: 05:00+2m > 05:50)    W=10:50 -> correction u1: 3; [05:00,10:00) fires;
    #       u2@11:00                                                   [00:00,05:00) purged (07:00 <= 10:50)
    #   b3: u2@02:00 (late: 07:00 <= 10:50) u1@12:00        W=11:50
    job = job_for(Tumbling(timedelta(minutes=5)), timedelta(minutes=2))
    batches = [
        [p(1, 30 * SEC), p(2, 4 * MIN + 50 * SEC), p(3, 1 * MIN, "u2")],
        [p(4, 5 * MIN + 20 * SEC), p(5, 6 * MIN, "u2")],
        [p(6, 3 * MIN), p(7, 11 * MIN, "u2")],
        [p(8, 2 * MIN, "u2"), p(9, 12 * MIN)],
    ]
    report, table, late = stream(spark, lake_home, job, batches)
    truth = oracle_run(job, batches)

    assert table == expected(truth)
    assert table[("u1", T0)][1] == 3, "the in-lateness event corrected the fired window"
    assert late == [("e8", "u2", T0, T0 + 5 * MIN)] == sorted((i, k, s, e) for i, k, s, e in truth.late)
    assert report.stats.rows_written == truth.writes == 5  # 4 windows, one of them written twice
    assert report.totals.watermark_out_ms == truth.watermark == T0 + 11 * MIN + 50 * SEC


def test_sliding_windows_count_an_event_in_every_window_and_a_late_event_only_where_it_missed(spark, lake_home):
    #   4-minute windows every 2 minutes, allowed lateness 1 min. u1@03:00 lies in [00:00,04:00) and
    #   [02:00,06:00). b1 moves W to 06:10, so both have fired when it arrives in b2: it is late for
    #   [00:00,04:00) (04:00+1m <= 06:10) but within lateness for [02:00,06:00) (06:00+1m > 06:10),
    #   which it corrects: one late row, one correction.
    job = job_for(Sliding(timedelta(minutes=4), timedelta(minutes=2)), timedelta(minutes=1))
    batches = [
        [p(1, 1 * MIN), p(2, 2 * MIN + 30 * SEC), p(3, 1 * MIN, "u2")],
        [p(4, 4 * MIN + 10 * SEC), p(5, 6 * MIN + 20 * SEC, "u2")],
        [p(6, 3 * MIN), p(7, 9 * MIN, "u2")],
        [p(8, 8 * MIN, "u1"), p(9, 13 * MIN, "u2")],
    ]
    report, table, late = stream(spark, lake_home, job, batches)
    truth = oracle_run(job, batches)

    assert table == expected(truth)
    assert ("e6", "u1", T0, T0 + 4 * MIN) in late and len([x for x in late if x[0] == "e6"]) == 1
    assert late == sorted(truth.late)
    assert table[("u1", T0 + 2 * MIN)][1] == 3  # e2, e4 and the corrected e6
    assert report.stats.rows_written == truth.writes > len(table)


def test_sessions_merge_and_retract_the_rows_they_absorb_then_later_events_go_aside(spark, lake_home):
    #   gap 5 min, allowed lateness 10 min (sessions are [first, last + 5m))
    #   b0: u1@00:00 u1@01:00                     S1=[00:00,06:00)                       W=00:50
    #   b1: u1@08:00 u2@14:00                     S2=[08:00,13:00)                       W=13:50 -> S1, S2 fire
    #   b2: u1@05:00 (bridges S1 and S2)          S=[00:00,13:00), 4 events              W=14:00 -> S fires:
    #       u2@14:10                              upsert (u1,00:00), delete (u1,08:00)
    #   b3: u1@02:00 (05:00+... not late)         S: 5 events, corrected                 W=39:50 -> S purged
    #       u2@40:00
    #   b4: u1@03:00 (03:00+5m+10m <= 39:50)      late -> side output                    W=40:50
    #       u2@41:00
    job = job_for(Session(timedelta(minutes=5)), timedelta(minutes=10))
    batches = [
        [p(1, 0), p(2, 1 * MIN)],
        [p(3, 8 * MIN), p(4, 14 * MIN, "u2")],
        [p(5, 5 * MIN), p(6, 14 * MIN + 10 * SEC, "u2")],
        [p(7, 2 * MIN), p(8, 40 * MIN, "u2")],
        [p(9, 3 * MIN), p(10, 41 * MIN, "u2")],
    ]
    report, table, late = stream(spark, lake_home, job, batches)
    truth = oracle_run(job, batches)

    assert table == expected(truth)
    assert table[("u1", T0)] == (T0 + 13 * MIN, 5, Decimal("50.00"))
    assert ("u1", T0 + 8 * MIN) not in table, "the absorbed session's row was retracted"
    assert report.stats.rows_deleted == truth.deletes == 1
    assert late == [("e9", "u1", T0 + 3 * MIN, T0 + 8 * MIN)] == sorted(truth.late)



def by_sql(frame):
    """A transform Spark sees as SQL over a view: nothing carries the original event through it."""
    frame.createOrReplaceTempView("window_test_payments")
    return frame.sparkSession.sql("SELECT user_id, event_time, event_id, amount FROM window_test_payments")


def by_position(frame):
    """A transform that renames the payment's columns by position: it cannot take an extra column."""
    return frame.select("event_id", "event_time", "user_id", "amount").toDF("event_id", "event_time", "user_id", "amount")


@pytest.mark.parametrize("window", [Tumbling(timedelta(minutes=5)), Sliding(timedelta(minutes=4), timedelta(minutes=2)),
                                    Session(timedelta(minutes=1))], ids=["tumbling", "sliding", "session"])
@pytest.mark.parametrize("transform", [amounts, by_sql, by_position], ids=["select", "sql-view", "by-position"])
def test_late_rows_keep_the_event_as_it_first_arrived_and_its_file_whatever_the_transform(spark, lake_home, window,
                                                                                           transform):
    """A late row's ``event`` holds every field of the line that first delivered it (the transform keeps only
    four) and ``source_file`` names that line's file, whether the transform passes rows through (a ``select``)
    or is SQL over a view, or renames its columns by position (it cannot take the carried column). Checked
    against the oracle's late (event, window) pairs and the landing files."""
    import json
    from dataclasses import replace

    job = replace(job_for(window, timedelta(minutes=1)), transform=transform)
    late_ones = [p(6, 3 * MIN, amount="7.25"), p(8, 30 * SEC, "u2", amount="1.50")]
    batches = [
        [p(1, 1 * MIN), p(2, 2 * MIN + 30 * SEC), p(3, 1 * MIN, "u2")],
        [p(4, 4 * MIN + 10 * SEC), p(5, 9 * MIN + 20 * SEC, "u2")],
        [*late_ones, p(7, 9 * MIN, "u2")],
        [p(6, 3 * MIN, amount="7.25"), p(9, 13 * MIN, "u2")],  # e6 delivered again: its first file counts
    ]
    report, table, late = stream(spark, lake_home, job, batches)
    truth = oracle_run(job, batches)
    assert table == expected(truth)
    assert late == sorted(truth.late) and {x[0] for x in late} == {"e6", "e8"}
    rows = spark.sql(f"SELECT event_id, unix_millis(window_start) ws, source, source_file, event FROM {SINK}_late").collect()
    assert sorted((r.event_id, r.ws) for r in rows) == sorted((x[0], x[2]) for x in late)
    first = {e["event_id"]: e for e in late_ones}
    for r in rows:
        assert r.source == "payments" and r.source_file.endswith("/batch-0002.jsonl"), (r.event_id, r.source_file)
        event = json.loads(r.event)
        sent = first[r.event_id]
        assert {k: event[k] for k in ("event_id", "user_id", "card_id", "merchant_id", "currency", "status")} == \
            {k: sent[k] for k in ("event_id", "user_id", "card_id", "merchant_id", "currency", "status")}
        assert Decimal(str(event["amount"])) == Decimal(str(sent["amount"]))


# -- the reconciliation law ---------------------------------------------------------------

@st.composite
def arrivals(draw):
    """Random events over 30 minutes for 3 users, each arriving after a random delay: mostly
    within the out-of-orderness bound, some minutes late; cut into 3-6 micro-batches, and a last
    batch whose event (another user, at 60 min) moves the watermark past every window."""
    n = draw(st.integers(25, 60))
    events = []
    for i in range(n):
        t = draw(st.integers(0, 30 * MIN))
        late = draw(st.booleans()) and draw(st.booleans())
        delay = draw(st.integers(1 * MIN, 12 * MIN)) if late else draw(st.integers(0, DELAY))
        events.append((t + delay, p(i, t, draw(st.sampled_from(["u1", "u2", "u3"])), f"{draw(st.integers(1, 99))}.00")))
    events.sort(key=lambda e: e[0])
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=2, max_size=5)))
    bounds = [0, *cuts, n]
    return [[e for _, e in events[a:b]] for a, b in zip(bounds, bounds[1:])] + [[p(n, 60 * MIN, "u9")]]


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(batches=arrivals(), lateness_min=st.sampled_from([0, 2]),
       window=st.sampled_from([Tumbling(timedelta(minutes=5)), Sliding(timedelta(minutes=6), timedelta(minutes=2))]))
def test_reconciliation_law_stream_plus_late_side_output_equals_bounded(spark, tmp_path_factory, batches, lateness_min,
                                                                       window):
    """For every window the stream has closed: its row + the late side output's rows for it = the bounded row."""
    from tests.conftest import settings_for

    drop_job_tables(spark, namespaces=("test",))
    lake = settings_for(tmp_path_factory.mktemp("law"))
    job = job_for(window, timedelta(minutes=lateness_min))
    report, table, late = stream(spark, lake, job, batches)
    watermark = report.totals.watermark_out_ms

    backfill(spark, lake, job, from_epoch_ms(T0 - 10 * MIN), from_epoch_ms(T0 + 90 * MIN), progress=None, force=True)
    bounded = read_windows(spark)
    all_events = [e for b in batches for e in with_t(b)]
    oracle = bounded_windows(all_events, win_of(window), key=lambda e: e["user_id"], measure=measure)
    assert bounded == {k: (v["window_end"], v["events"], v["amount"]) for k, v in oracle.items()}

    late_count: dict = {}
    for _id, user, ws, _we in late:
        late_count[(user, ws)] = late_count.get((user, ws), 0) + 1
    checked = 0
    for key, (we, events, _amount) in bounded.items():
        if we > watermark:
            continue  # not closed in the stream yet
        streamed = table.get(key, (we, 0, None))[1]
        assert streamed + late_count.get(key, 0) == events, key
        checked += 1
    assert checked >= len([k for k in bounded if k[0] != "u9"])  # every window of the 30 minutes closed
    assert set(late_count) <= set(bounded), "every late row belongs to a window of the bounded result"


# -- the store's compaction ------------------------------------------------------------------

def many_batches(n: int = 30) -> list[list[dict]]:
    """``n`` one-file batches, 20 s of event time apart: u1 every batch, u2 in bursts of 10 batches
    (gaps of 200 s close its sessions), an event 4 minutes behind every 7th batch (late or a
    correction), re-deliveries near the end of events from the first batches (their ids live
    only in the compacted file by then), and a last batch that closes every window."""
    batches = []
    for i in range(n):
        at = i * 20 * SEC
        batch = [p(f"a{i}", at, "u1", f"{i % 9 + 1}.00")]
        if (i // 10) % 2 == 0:
            batch.append(p(f"b{i}", at + 5 * SEC, "u2", "2.00"))
        if i % 7 == 3 and i >= 12:
            batch.append(p(f"c{i}", at - 4 * MIN, "u2", "3.00"))
        if i >= n - 4:
            j = i - (n - 5)
            batch.append(p(f"a{j}", j * 20 * SEC, "u1", f"{j % 9 + 1}.00"))  # a re-delivery
        batches.append(batch)
    return batches + [[p("z", 90 * MIN, "u9")]]


@pytest.mark.parametrize("window, by_driver", [(Tumbling(timedelta(minutes=2)), True),
                                               (Tumbling(timedelta(minutes=15)), True),
                                               (Tumbling(timedelta(minutes=15)), False),
                                               (Session(timedelta(minutes=3)), True)],
                         ids=["tumbling", "tumbling-long", "tumbling-long-merged-by-spark", "session"])
def test_a_stream_of_more_batches_than_the_store_keeps_files_compacts_alongside_and_loses_nothing(spark, lake_home,
                                                                                                window, by_driver,
                                                                                                monkeypatch):
    """The store's small files are merged while batches run: by the driver (pyarrow, few rows: ids, and a tumbling
    job's pieces), or by Spark (more rows than ``DRIVER_MERGE_ROWS``, or a session job's pieces); either way the
    windows, the late rows and the re-deliveries found among the merged ids match the oracle."""
    import streaming.windowed.compaction as compaction
    from streaming.checkpoint.layout import Layout
    from streaming.checkpoint.store import COMPACT_EVERY

    if not by_driver:
        monkeypatch.setattr(compaction, "DRIVER_MERGE_ROWS", 0)
    merged_by = []
    read = compaction.Store.read_table
    monkeypatch.setattr(compaction.Store, "read_table", lambda self, kind, files: merged_by.append(kind) or read(self, kind, files))
    batches = many_batches()
    assert len(batches) > COMPACT_EVERY + 4
    job = job_for(window, timedelta(minutes=1))
    report, table, late = stream(spark, lake_home, job, batches)
    truth = oracle_run(job, batches)

    assert table == expected(truth)
    assert late == sorted((i, k, s, e) for i, k, s, e in truth.late)
    assert report.stats.duplicates == 4, "re-deliveries found among the compacted ids"
    store = Path(Layout(lake_home.checkpoint_dir(job.name)).store)
    assert any(d.name.startswith("c") for d in store.iterdir()), "the store was compacted"
    # (2-minute windows close before their pieces reach ``COMPACT_EVERY`` files, 15-minute ones do not; a session's
    # pieces are merged by Spark)
    pieces = {"pieces"} if getattr(window, "size_ms", 0) > 10 * MIN else set()
    assert set(merged_by) == ({"ids", *pieces} if by_driver else set())


@pytest.mark.parametrize("seed", range(6))
def test_the_drivers_merge_of_pieces_matches_plain_python_as_sparks_does(spark, seed):
    """A tumbling or sliding job's pieces merged by the driver (``compaction._open_pieces``: pyarrow), and by Spark
    (``Aggregates.merge``, as a merge of many files does), against plain Python: random keys (NULL ones among them),
    windows, counts, decimal sums, least and greatest values with NULLs (left out; NULL when all are), and the windows
    closed at the watermark (beyond lateness) dropped."""
    import random

    import pyarrow as pa
    from pyspark.sql import types as T

    from streaming.io.schemas import types_of
    from streaming.windowed.aggregates import Aggregates
    from streaming.windowed.compaction import _merged_by_driver, _open_pieces

    rng = random.Random(seed)
    job = WindowedJob(
        name="merge_test", sources=(PAYMENTS,), keys=("user_id",), window=Tumbling(timedelta(minutes=1)),
        watermark=Watermark(timedelta(seconds=5), allowed_lateness=timedelta(seconds=rng.choice([0, 30]))),
        transform=amounts, sink=Table(SINK),
        aggregates=(Agg.count("events"), Agg.sum("amount", "amount"), Agg.min("amount", "least"),
                    Agg.max("amount", "most")))
    assert _merged_by_driver(job)
    types = types_of(job, T.StructType([T.StructField("amount", T.DecimalType(18, 2))]))
    assert (types["events"], types["amount"], types["least"]) == (T.LongType(), T.DecimalType(38, 2), T.DecimalType(18, 2))
    rows = []
    for _ in range(rng.randint(1, 300)):
        ws = rng.randrange(10) * MIN
        amount = lambda: None if rng.random() < 0.3 else Decimal(rng.randint(0, 10**6)) / 100  # noqa: E731
        rows.append((rng.choice(["a", "b", "c", None]), ws, ws + MIN, rng.randint(0, 5), amount(), amount(), amount()))
    watermark, lateness = rng.randrange(12) * MIN, job.watermark.allowed_lateness_ms

    want: dict[tuple, list] = {}
    for key, ws, we, n, total, least, most in rows:
        if we + lateness <= watermark:
            continue
        w = want.setdefault((key, ws), [key, ws, we, 0, None, None, None])
        w[3] += n
        w[4] = total if w[4] is None else w[4] if total is None else w[4] + total
        w[5] = least if w[5] is None else w[5] if least is None else min(w[5], least)
        w[6] = most if w[6] is None else w[6] if most is None else max(w[6], most)
    want = {k: tuple(v) for k, v in want.items()}

    arrow = pa.schema([("user_id", pa.string()), ("ws", pa.int64()), ("we", pa.int64()), ("events", pa.int64()),
                       ("amount", pa.decimal128(38, 2)), ("least", pa.decimal128(18, 2)), ("most", pa.decimal128(18, 2))])
    got = _open_pieces(job, pa.Table.from_pylist([dict(zip(arrow.names, r)) for r in rows], schema=arrow), watermark)
    assert got.schema == arrow
    assert {(r["user_id"], r["ws"]): tuple(r.values()) for r in got.to_pylist()} == want
    pieces = spark.createDataFrame(rows, "user_id string, ws long, we long, events long, amount decimal(38,2), "
                                         "least decimal(18,2), most decimal(18,2)")
    by_spark = Aggregates(job, types).merge(pieces).collect()
    assert {(r.user_id, r.ws): tuple(r) for r in by_spark if r.we + lateness > watermark} == want


def test_ids_remembered_in_minute_buckets_by_an_earlier_version_still_catch_re_deliveries(spark, lake_home, monkeypatch):
    """Checkpoints written before remembered ids had one-second buckets keep their one-minute files:
    a stream resumed on them still finds re-deliveries of the events they hold."""
    import streaming.spark.columns
    import streaming.checkpoint.store

    batches = many_batches()
    folder = lake_home.landing_dir("payments")

    def run(job):
        streaming.spark.columns._BUILT.clear()  # noqa: SLF001 - expressions built with the other bucket width
        settings = lake_home.with_job(job.name, max_files_per_trigger=1)
        return run_stream(spark, settings, job, available_now=True, progress=None, install_signal_handlers=False)

    window, lateness = Tumbling(timedelta(minutes=2)), timedelta(minutes=1)
    with monkeypatch.context() as m:
        m.setattr(streaming.checkpoint.store, "BUCKET_MS", streaming.checkpoint.store.LEGACY_BUCKET_MS)
        write_batches(folder, batches[:10])
        first = run(job_for(window, lateness))
    write_batches(folder, batches[10:], start=10)
    second = run(job_for(window, lateness))
    truth = oracle_run(job_for(window, lateness), batches)

    assert read_windows(spark) == expected(truth)
    assert read_late(spark) == sorted((i, k, s, e) for i, k, s, e in truth.late)
    assert (first.stats.duplicates, second.stats.duplicates) == (0, 4), "re-deliveries of events in minute-bucket files"


def test_a_backfill_whose_transform_reads_fields_it_drops_keeps_them_for_it(spark, lake_home):
    """The bounded run caches only the fields the transform reads: one that filters on ``currency``
    and ``card_id`` and outputs neither must still see them (else Spark refuses the plan, or the
    filter sees nulls). Checked against a plain-Python count over the same events."""
    from pyspark.sql import functions as F

    from streaming.io.parse import parse_sources
    from streaming.windowed.batch import transform_inputs

    def euro_cards(frame):
        kept = frame.where((F.col("currency") == "EUR") & F.col("card_id").startswith("c-"))
        return kept.select("user_id", "event_time", "event_id", "amount")

    job = WindowedJob(
        name="window_test", sources=(PAYMENTS,), keys=("user_id",), window=Tumbling(timedelta(minutes=5)),
        watermark=Watermark(timedelta(milliseconds=DELAY)), transform=euro_cards,
        aggregates=(Agg.count("events"), Agg.sum("amount", "amount")), sink=Table(SINK),
    )
    events = [p(i, i * 7 * SEC, user=f"u{i % 3}", amount=f"{i % 5 + 1}.00") for i in range(40)]
    for i, e in enumerate(events):
        if i % 4 == 0:
            e["currency"] = "USD"
        if i % 6 == 0:
            e["card_id"] = f"x-{e['user_id']}"
    write_batches(lake_home.landing_dir("payments"), [events])
    backfill(spark, lake_home, job, from_epoch_ms(T0 - 10 * MIN), from_epoch_ms(T0 + 60 * MIN), progress=None, force=True)

    want: dict = {}
    for e in events:
        if e["currency"] == "EUR" and e["card_id"].startswith("c-"):
            t = with_t([e])[0]["t_ms"]
            ws = t - t % (5 * MIN)
            n, amount = want.get((e["user_id"], ws), (0, Decimal("0")))
            want[(e["user_id"], ws)] = (n + 1, amount + Decimal(str(e["amount"])))
    assert {k: (v[1], v[2]) for k, v in read_windows(spark).items()} == want
    assert sum(n for n, _ in want.values()) == 40 - len([i for i in range(40) if i % 4 == 0 or i % 6 == 0])
    # (A field pruned wrongly would not fail the run: Spark resolves it below the cache and parses the
    # lines again. So the kept fields are checked too.)
    parsed = parse_sources(job, spark.createDataFrame([], "value string, source_file string"))
    assert transform_inputs(job, parsed.schema) == {"user_id", "event_time", "event_id", "amount", "currency", "card_id"}


@pytest.mark.parametrize("small, max_repeats, by_size, written, paths", [
    (0, 10_000, False, False, ["stats"] * 3), (0, 10_000, True, False, ["stats"] * 3),
    (0, 10_000, True, True, ["written", "stats", "stats"]), (0, 1, True, True, ["written", "stats", "stats"]),
    (0, 1, False, False, ["stats"] * 3), (None, 10_000, False, False, ["stats"] * 3),
    (None, 10_000, False, True, ["driver"] * 3)],
    ids=["filtered", "filtered-first-by-size", "filtered-first-written-by-its-statistics",
         "too-many-repeats-first-written-by-its-statistics", "too-many-repeats", "small-batch",
         "small-batch-ids-aggregated"])
def test_ids_delivered_again_within_a_batch_count_once_and_the_first_line_wins(spark, lake_home, monkeypatch,
                                                                                small, max_repeats, by_size, written,
                                                                                paths):
    """A stream's batch drops repeats within it by their hashes, without a shuffle, keeping the first line
    of an id; with more repeated ids than it filters (``MAX_REPEATS``) it numbers each id's deliveries instead.
    A batch whose input is at most ``DRIVER_LOOKUP_BYTES`` finds its repeats on the driver, from the ids its
    statistics job brings as Arrow (``stats``); one whose ids do not come to the driver (``written``): a large first
    batch writes them in its statistics job and reads its repeats back from that file, a later one expected to be
    large (after a large one, or by the size of its input files) finds them in its statistics job, and one of
    ordinary size has them aggregated into one row (``driver``)."""
    want_paths = paths
    import streaming.windowed.batch

    monkeypatch.setattr(streaming.windowed.batch, "MAX_REPEATS", max_repeats)
    if written:  # (no batch brings its ids to the driver)
        monkeypatch.setattr(streaming.windowed.batch, "DRIVER_LOOKUP_BYTES", 0)
    wrote = streaming.windowed.batch.WindowedBatch._repeats_and_ids
    monkeypatch.setattr(streaming.windowed.batch.WindowedBatch, "_repeats_and_ids",
                        lambda self, lines: paths.append("written") or wrote(self, lines))
    if not by_size:  # (the first batch is not known to be large)
        monkeypatch.setattr(streaming.windowed.batch, "LARGE_BATCH_BYTES", 10**15)
    else:
        monkeypatch.setattr(streaming.windowed.batch, "LARGE_BATCH_BYTES", 0)
    if small is not None:  # (these batches are small: make the batches after the first count as large)
        monkeypatch.setattr(streaming.windowed.batch, "INTERPRETED_BATCH_LINES", small)
    paths = []  # where each batch found its repeats (``want_paths``: where each should)
    find = streaming.windowed.batch.WindowedBatch._find_repeats
    monkeypatch.setattr(streaming.windowed.batch.WindowedBatch, "_find_repeats",
                        lambda self, lines: paths.append("stats" if self.expect_large else "job") or find(self, lines))
    both = streaming.windowed.batch.WindowedBatch._repeats_and_remembered  # (with remembered ids: on the driver)
    monkeypatch.setattr(streaming.windowed.batch.WindowedBatch, "_repeats_and_remembered",
                        lambda self, lines: paths.append("stats") or both(self, lines))
    ordinary = streaming.windowed.batch.WindowedBatch._stats_and_ids  # (a batch of ordinary size: on the driver)
    monkeypatch.setattr(streaming.windowed.batch.WindowedBatch, "_stats_and_ids",
                        lambda self: paths.append("driver") or ordinary(self))
    job = job_for(Tumbling(timedelta(minutes=5)), timedelta(0))
    batches = [
        # e1 three times, the same line; e2 twice, differing in amount; e3 once; e4 again in the next batch
        [p(1, 10 * SEC), p(2, 20 * SEC, amount="10.00"), p(1, 10 * SEC), p(3, 30 * SEC, "u2"), p(1, 10 * SEC),
         p(2, 20 * SEC, amount="99.00"), p(4, 40 * SEC)],
        # e7 twice, differing in amount
        [p(4, 40 * SEC), p(5, 6 * MIN), p(7, 7 * MIN, amount="5.00"), p(6, 6 * MIN + SEC, "u2"), p(5, 6 * MIN),
         p(7, 7 * MIN, amount="50.00")],
        [p(8, 11 * MIN, "u3")],  # (moves the watermark past the second window)
    ]
    report, table, late = stream(spark, lake_home, job, batches)
    truth = oracle_run(job, batches)  # (the oracle keeps the first delivery of an id, in arrival order)

    assert report.stats.duplicates == 6 and report.stats.events == 8
    assert late == [] == truth.late
    second = ("u1", T0 + 5 * MIN)
    assert paths == want_paths, paths
    if max_repeats > 1:
        assert table == expected(truth)
        assert table[("u1", T0)][1:] == (3, Decimal("30.00")), "e2 counted once, with its first line's amount"
        assert table[second][1:] == (2, Decimal("15.00")), "e7 counted once, with its first line's amount"
    else:
        assert {k: v[:2] for k, v in table.items()} == {k: v[:2] for k, v in expected(truth).items()}
        assert table[("u1", T0)][2] in (Decimal("30.00"), Decimal("119.00"))
        assert table[second][2] in (Decimal("15.00"), Decimal("60.00"))


def test_a_cached_frame_as_a_leaf_reads_the_same_rows_from_the_cache_and_after_it_is_dropped(spark):
    """The batch builds its frames on its caches as plans of one node (``spark.jvm.cached_leaf``)."""
    from pyspark.sql import functions as F

    from streaming.spark.jvm import cached_leaf

    data = [(i, f"k{i % 7}") for i in range(100)]
    frame = spark.createDataFrame(data, "n long, k string").where(F.col("n") % 3 != 0).withColumn("m", F.col("n") * 2)
    want = sorted((n, k, n * 2) for n, k in data if n % 3 != 0)
    assert cached_leaf(frame) is frame, "not cached: the frame itself"
    frame.persist()
    try:
        leaf = cached_leaf(frame)
        plan = leaf._jdf.queryExecution().analyzed()  # noqa: SLF001
        assert plan.children().isEmpty() and "InMemoryRelation" in plan.getClass().getName()
        assert sorted(tuple(r) for r in leaf.collect()) == want
        assert sorted(tuple(r) for r in leaf.where(F.col("k") == "k1").collect()) == [w for w in want if w[1] == "k1"]
    finally:
        frame.unpersist()
    assert sorted(tuple(r) for r in leaf.collect()) == want, "after unpersist: computed again from its lineage"


def test_a_continuous_stream_on_the_default_trigger_takes_each_file_as_it_arrives_after_quiet_spells(spark, lake_home):
    """The default trigger starts a batch as soon as input waits (and an idle stream's listings wait for its
    landing folder to change): files arriving one by one, with quiet spells between them, are each read
    in a batch of their own, and the result is the oracle's for that arrival."""
    import threading
    import time

    job = job_for(Tumbling(size=timedelta(minutes=1)), timedelta(0))
    assert lake_home.job(job.name).trigger_interval is None  # (the default)
    batches = [[p(1, 0), p(2, 20 * SEC, "u2")], [p(3, 50 * SEC), p(4, 80 * SEC)], [p(5, 100 * SEC, "u2"), p(6, 5 * SEC)],
               [p(7, 200 * SEC)]]
    stop, reports, errors = threading.Event(), [], []

    def run():
        try:
            reports.append(run_stream(spark, lake_home, job, available_now=False, progress=None, stop_event=stop,
                                      install_signal_handlers=False))
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    commits = Path(lake_home.checkpoint_dir(job.name)) / "commits"
    try:
        for i, batch in enumerate(batches):
            time.sleep(1.5)  # a quiet spell: the stream idles, its listings wait for the folder to change
            write_batches(lake_home.landing_dir("payments"), [batch], start=i)
            deadline = time.monotonic() + 60
            while not errors and time.monotonic() < deadline and not (commits / str(i)).exists():
                time.sleep(0.1)
            assert (commits / str(i)).exists(), f"file {i} was not committed"
    finally:
        stop.set()
        runner.join(60)
    assert not errors, errors
    truth = oracle_run(job, batches)
    assert read_windows(spark) == expected(truth)
    assert read_late(spark) == sorted(truth.late)
