"""Where the event-time rules meet the edges an operator's input reaches: backfill ranges that end inside
windows, an event exactly on the lateness boundary of a session, files copied in with old modification
times, keys that are NULL, and Parquet files larger than what a task may read whole. Every result is
checked against the plain-Python oracle (``tests/oracle_windows.py``)."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pandas as pd
import pytest

from batch.backfill import backfill
from lakestream.testing import JobHarness
from streaming.declaration import Agg, Field, Source, Table, Watermark, WindowedJob
from streaming.time import from_epoch_ms
from streaming.windows import Session, Sliding, Tumbling
from tests.landing import MIN, SEC, T0, iso, with_t, write_batches
from tests.oracle_windows import bounded_windows, replay_windows
from tests.test_windows import (  # noqa: F401 - lake_home is a fixture
    DELAY, SINK, job_for, lake_home, measure, p, read_late, read_windows, stream, win_of)


@pytest.mark.parametrize("window, lo_min, hi_min", [
    (Tumbling(timedelta(minutes=5)), 0, 7),             # the range ends inside the window [05:00, 10:00)
    (Tumbling(timedelta(minutes=5)), 3, 12),            # ... and starts inside [00:00, 05:00)
    (Sliding(timedelta(minutes=6), timedelta(minutes=2)), 0, 7),  # ends off the slide: [06:00, 12:00) starts in it
    (Sliding(timedelta(minutes=10), timedelta(minutes=1)), 1.5, 6.5),
], ids=["tumbling-end", "tumbling-both", "sliding-off-slide", "sliding-long"])
def test_a_backfill_whose_range_cuts_windows_writes_every_window_starting_in_it_whole(spark, lake_home, window, lo_min,
                                                                                     hi_min):
    events = [p(i, int(i * 17 * SEC), f"u{i % 3}") for i in range(60)]  # 00:00 .. 16:43, every 17 s
    write_batches(lake_home.landing_dir("payments"), [events])
    job = job_for(window, timedelta(0))
    lo, hi = T0 + int(lo_min * MIN), T0 + int(hi_min * MIN)
    backfill(spark, lake_home, job, from_epoch_ms(lo), from_epoch_ms(hi), progress=None)
    oracle = bounded_windows(with_t(events), win_of(window), key=lambda e: e["user_id"], measure=measure)
    expected = {k: (v["window_end"], v["events"], v["amount"]) for k, v in oracle.items() if lo <= k[1] < hi}
    assert read_windows(spark) == expected and expected
    assert max(we for we, *_ in expected.values()) > hi  # a window that ends after the range is in it, complete


def test_a_session_event_exactly_on_the_lateness_boundary_goes_to_the_late_side_output(spark, lake_home):
    #   gap 1 min, lateness 2 min, watermark = max - 10 s.
    #   b0: u1@00:00, u9@10:00                         W = 09:50
    #   b1: u1@06:50: its window [06:50, 07:50) + 2 min = 09:50 <= W: late, exactly on the boundary
    #       u2@06:51: [06:51, 07:51) + 2 min = 09:51 > W: on time, 1 ms inside
    job = job_for(Session(timedelta(minutes=1)), timedelta(minutes=2))
    batches = [[p(1, 0), p(2, 10 * MIN, "u9")],
               [p(3, 6 * MIN + 50 * SEC, "u1"), p(4, 6 * MIN + 51 * SEC, "u2")],
               [p(5, 30 * MIN, "u9")]]
    report, table, late = stream(spark, lake_home, job, batches)
    truth = replay_windows([with_t(b) for b in batches], win_of(job.window), delay=DELAY,
                           lateness=job.watermark.allowed_lateness_ms, key=lambda e: e["user_id"], measure=measure)
    assert late == sorted(truth.late) == [("e3", "u1", T0 + 6 * MIN + 50 * SEC, T0 + 7 * MIN + 50 * SEC)]
    assert ("u2", T0 + 6 * MIN + 51 * SEC) in table and ("u1", T0 + 6 * MIN + 50 * SEC) not in table
    assert table == {k: (v["window_end"], v["events"], v["amount"]) for k, v in truth.table.items()}


def test_a_landing_file_copied_in_with_a_ten_day_old_modification_time_is_read(spark, lake_home):
    job = job_for(Tumbling(timedelta(minutes=5)), timedelta(minutes=10))
    landing = Path(lake_home.landing_dir("payments"))
    first = [p(1, 0), p(2, MIN)]
    stream(spark, lake_home, job, [first])
    copied = landing / "copied-with-its-times.jsonl"  # as cp -p, rsync -a or tar x leave it
    copied.write_text("\n".join(json.dumps(e) for e in [p(3, 2 * MIN), p(4, 20 * MIN, "u9")]) + "\n")
    ten_days_older = os.stat(landing / "batch-0000.jsonl").st_mtime - 10 * 86400
    os.utime(copied, (ten_days_older, ten_days_older))
    report, table, _ = stream(spark, lake_home, job, [])
    assert report.stats.events == 2
    assert table[("u1", T0)][1] == 3  # e3 counted in the window it belongs to (within lateness)


# -- NULL keys -----------------------------------------------------------------------------------------------

VISITS = Source(name="visits", fields=(Field("event_id", "string"), Field("event_time", "timestamp"),
                                       Field("user_id", "string", required=False), Field("amount", "double")))


def visits_job(window, lateness: timedelta) -> WindowedJob:
    return WindowedJob(name="null_keys", sources=(VISITS,), keys=("user_id",), window=window,
                       watermark=Watermark(timedelta(seconds=10), allowed_lateness=lateness),
                       transform=lambda f: f.select("user_id", "event_time", "event_id", "amount"),
                       aggregates=(Agg.count("events"), Agg.sum("amount", "amount")),
                       sink=Table("lake.test.null_keys"))


def visit(i, offset, user) -> dict:
    return {"event_id": f"v{i}", "t_ms": T0 + offset, "user_id": user, "amount": Decimal("1.0")}


def line(event: dict) -> str:
    record = {"event_id": event["event_id"], "event_time": iso(event["t_ms"]), "amount": 1.0}
    if event["user_id"] is not None:
        record["user_id"] = event["user_id"]
    return json.dumps(record)


@pytest.mark.parametrize("fmt", ["iceberg", "delta"])
@pytest.mark.parametrize("window", [Tumbling(timedelta(minutes=5)), Session(timedelta(minutes=3))],
                         ids=["tumbling", "session"])
def test_events_whose_key_is_null_form_a_group_of_their_own_in_the_stream_the_twin_and_reconciliation(
        spark, tmp_path, window, fmt):
    #   watermark = max - 10 s, lateness 20 min; the NULL key's events:
    #   b0: @00:00 @01:00                    tumbling [00:00, 05:00): 2    sessions (gap 3 m): [00:00, 04:00)
    #   b1: @04:30                           [00:00, 05:00): 3 (fires)     [04:30, 07:30): a session of its own
    #   b2: @02:00 (within lateness)         corrected: 4                  bridges both: [00:00, 07:30), 4 events,
    #                                                                      one row upserted, the other deleted
    batches = [[visit(1, 0, None), visit(2, MIN, None), visit(3, 30 * SEC, "a")],
               [visit(4, 4 * MIN + 30 * SEC, None), visit(5, 9 * MIN, "a")],
               [visit(6, 2 * MIN, None), visit(7, 40 * MIN, "b")]]
    job = visits_job(window, timedelta(minutes=20))
    harness = JobHarness(job, tmp_path, format=fmt)
    out = harness.stream([[line(e) for e in b] for b in batches])
    truth = replay_windows(batches, win_of(window), delay=10 * SEC, lateness=20 * MIN, key=lambda e: e["user_id"],
                           measure=lambda events: {"events": len(events)})
    got = [(None if pd.isna(r.user_id) else r.user_id, int(r.window_start.timestamp() * 1000), r.events)
           for r in out.main.itertuples()]
    assert len({g[:2] for g in got}) == len(got), "a window written twice"
    assert {g[:2]: g[2] for g in got} == {k: v["events"] for k, v in truth.table.items()}
    assert (None, T0, 4) in got
    assert harness.reconcile().unexplained == 0


# -- Parquet files of any size ---------------------------------------------------------------------------

READINGS = Source(name="readings", format="parquet",
                  fields=(Field("event_id", "string"), Field("event_time", "timestamp"), Field("device", "string"),
                          Field("value", "double")))
READINGS_JOB = WindowedJob(name="readings_per_minute", sources=(READINGS,), keys=("device",),
                           window=Tumbling(timedelta(minutes=1)), watermark=Watermark(timedelta(seconds=5)),
                           transform=lambda f: f, aggregates=(Agg.count("readings"), Agg.sum("value", "total")),
                           sink=Table("lake.test.readings_per_minute"))


def test_a_parquet_file_larger_than_a_task_may_read_whole_streams_in_chunks(spark, tmp_path):
    from streaming.io.sources import files

    rows = 60_000
    frame = pd.DataFrame({
        "event_id": [f"r{i}" for i in range(rows)],
        "event_time": pd.to_datetime([T0 + i * 10 for i in range(rows)], unit="ms", utc=True),
        "device": [f"d{i % 7}" for i in range(rows)],
        "value": [float(i % 13) for i in range(rows)],
    })
    harness = JobHarness(READINGS_JOB, tmp_path)
    limit = spark.conf.get("spark.sql.sources.binaryFile.maxLength", None)
    spark.conf.set("spark.sql.sources.binaryFile.maxLength", str(256 * 1024))  # the file is ~1 MB: over the limit
    try:
        out = harness.stream([frame, pd.DataFrame([{"event_id": "z", "event_time": pd.Timestamp(T0 + 3600_000, unit="ms",
                                                     tz="UTC"), "device": "d0", "value": 0.0}])])
    finally:
        if limit is None:
            spark.conf.unset("spark.sql.sources.binaryFile.maxLength")
        else:
            spark.conf.set("spark.sql.sources.binaryFile.maxLength", limit)
    assert rows > 4 * files.PARQUET_CHUNK_ROWS  # (read in several chunks)
    frame["ws"] = (frame["event_time"].astype("int64") // 1_000_000 // 60_000) * 60_000
    expected = frame.groupby(["device", "ws"]).agg(readings=("event_id", "count"), total=("value", "sum"))
    got = {(r.device, int(r.window_start.timestamp() * 1000)): (r.readings, r.total) for r in out.main.itertuples()}
    assert got == {k: (v.readings, v.total) for k, v in expected.iterrows()}
    assert out.quarantine.empty


@pytest.mark.parametrize("window", [Tumbling(timedelta(minutes=5)), Session(timedelta(minutes=1))],
                         ids=["tumbling", "session"])
def test_a_re_delivery_stamped_with_another_event_time_counts_once_where_it_first_arrived(spark, lake_home, window):
    """A producer that stamps its retries anew: the id's first delivery counts (its event time decides the
    window), every later one is a duplicate — in a later batch (looked up whatever its event time), in the same
    batch (the earlier file, then the earlier line), and in the bounded twin, also over a range that holds only
    the re-delivery's event time. Checked against the plain-Python oracle (first delivery by arrival)."""
    moved = dict(p(1, 1 * MIN, "u1", "7.00"), event_time=iso(T0 + 12 * MIN))  # e1 again, 11 minutes later
    batches = [
        [p(1, 1 * MIN, "u1", "7.00"), p(2, 2 * MIN, "u2")],
        [dict(p(4, 13 * MIN, "u3"), event_time=iso(T0 + 4 * MIN)),       # e4 first stamped 04:00 ...
         p(4, 13 * MIN, "u3"), p(5, 14 * MIN, "u2"), p(3, 3 * MIN, "u2")],  # ... then 13:00 in the same file
        [moved],                                                         # a later batch: dropped
        [p(9, 60 * MIN, "u9")],                                          # closes everything
    ]
    report, table, late = stream(spark, lake_home, job_for(window, timedelta(0)), batches)
    truth = replay_windows([with_t(b) for b in batches], win_of(window), delay=DELAY, lateness=0,
                           key=lambda e: e["user_id"], measure=measure)
    assert table == {k: (v["window_end"], v["events"], v["amount"]) for k, v in truth.table.items()}
    first_seen = {(u, ws - T0) for u, ws in table if u in ("u1", "u3")}
    assert first_seen == ({("u1", 1 * MIN), ("u3", 4 * MIN)} if isinstance(window, Session) else {("u1", 0), ("u3", 0)})
    assert not late

    harness = JobHarness(job_for(window, timedelta(0)), lake_home.home, settings=lake_home)
    everything = harness.bounded()
    first = {}
    for e in with_t([e for b in batches for e in b]):
        first.setdefault(e["event_id"], e)
    oracle = bounded_windows(list(first.values()), win_of(window), key=lambda e: e["user_id"], measure=measure)
    assert {(r.user_id, int(r.window_start.timestamp() * 1000)): int(r.events) for r in everything.main.itertuples()} \
        == {k: v["events"] for k, v in oracle.items()}
    later = harness.bounded(from_epoch_ms(T0 + 10 * MIN), from_epoch_ms(T0 + 15 * MIN))  # holds only the re-stamps
    assert sorted(later.main.user_id) == ["u2"] and int(later.main.events.sum()) == 1, "only e5 counts there"


@pytest.mark.parametrize("limit, driver_lines, large", [(None, None, False), (1, None, False), (None, 0, False),
                                                        (None, None, True), (None, 0, True)],
                         ids=["filtered", "too-many-joined", "too-many-lines-joined", "large-filtered", "large-joined"])
def test_a_whole_file_delivered_again_in_a_later_batch_counts_once(spark, lake_home, monkeypatch, limit, driver_lines,
                                                                   large):
    """An operator drops yesterday's file into the landing folder again, under a new name: every id of that batch
    is remembered. A batch's statistics job brings its ids' hashes, the driver finds the remembered ones, and the
    events are filtered; more of them than it filters (``limit``), or a batch with more lines than come to the
    driver (``driver_lines``, and bytes for a large one), go through the executors' lookup joined with the events instead. A batch expected to
    be large (``large``) brings its ids with their deliveries, and the driver finds its repeats too. Either way each
    event counts once, as in the plain-Python oracle."""
    import streaming.windowed.batch as windowed_batch

    if large:  # (these batches are small: make them count as large)
        monkeypatch.setattr(windowed_batch, "LARGE_BATCH_BYTES", 0)
        monkeypatch.setattr(windowed_batch, "INTERPRETED_BATCH_LINES", 0)
    if limit is not None:
        monkeypatch.setattr(windowed_batch, "MAX_REPEATS", limit)
    if driver_lines is not None:
        monkeypatch.setattr(windowed_batch, "DRIVER_LOOKUP_LINES", driver_lines)
        monkeypatch.setattr(windowed_batch, "DRIVER_LOOKUP_BYTES", driver_lines)
    joined = []  # the batches whose events joined the executors' lookup
    remembered = windowed_batch.WindowedBatch._remembered
    monkeypatch.setattr(windowed_batch.WindowedBatch, "_remembered",
                        lambda self, events: (lambda got: joined.append(got is not None) or got)(remembered(self, events)))
    first = [p(1, 1 * MIN, "u1", "7.00"), p(2, 2 * MIN, "u2"), p(3, 3 * MIN, "u1", "2.50")]
    batches = [first, [p(4, 4 * MIN, "u2")], [*first, p(5, 6 * MIN, "u3")], [p(9, 60 * MIN, "u9")]]
    window = Tumbling(timedelta(minutes=5))
    report, table, late = stream(spark, lake_home, job_for(window, timedelta(minutes=10)), batches)
    truth = replay_windows([with_t(b) for b in batches], win_of(window), delay=DELAY, lateness=10 * MIN,
                           key=lambda e: e["user_id"], measure=measure)
    assert table == {k: (v["window_end"], v["events"], v["amount"]) for k, v in truth.table.items()}
    assert table[("u1", T0)][1] == 2 and not late
    assert any(joined) == (limit is not None or driver_lines is not None), "the batch with remembered ids took its path"


@pytest.mark.parametrize("on_driver, large", [(True, False), (False, False), (True, True), (False, True)],
                         ids=["written-by-the-driver", "written-by-spark", "large-written-by-the-driver",
                              "large-written-by-the-statistics"])
def test_the_ids_a_batch_remembers_are_its_first_deliveries_with_their_expiry(spark, lake_home, monkeypatch, on_driver,
                                                                              large):
    """The store's ids of each batch (``checkpoint.store``): one per id the batch counts (its first delivery;
    none of an id an earlier batch counted, whatever its event time now), in its event-time second, forgotten at
    ``max(event time, W_in) + dedup_ttl``. A small batch's ids come from its statistics job and the driver writes
    them; a batch expected to be large brings one row per id with its first delivery's event time, and the driver
    writes them too; a large batch whose ids do not come to the driver, and that no remembered id concerns (the
    first), writes that aggregate in its statistics job; the Spark path (a frame over the events) must say the same.
    Checked against a plain-Python oracle."""
    import pyarrow.parquet as pq

    import streaming.windowed.batch as windowed_batch
    from streaming.checkpoint.layout import Layout

    brought = []  # the batches whose statistics brought every id, one row each (the large path)
    wrote = []  # the batches whose statistics job wrote their ids
    if large:  # (these batches are small: make them count as large)
        monkeypatch.setattr(windowed_batch, "LARGE_BATCH_BYTES", 0)
        monkeypatch.setattr(windowed_batch, "INTERPRETED_BATCH_LINES", 0)
        every = windowed_batch.WindowedBatch._repeats_and_remembered
        monkeypatch.setattr(windowed_batch.WindowedBatch, "_repeats_and_remembered",
                            lambda self, lines: brought.append(self.batch_id) or every(self, lines))
        if not on_driver:  # (no batch brings its ids to the driver)
            monkeypatch.setattr(windowed_batch, "DRIVER_LOOKUP_BYTES", 0)
        written = windowed_batch.WindowedBatch._repeats_and_ids
        monkeypatch.setattr(windowed_batch.WindowedBatch, "_repeats_and_ids",
                            lambda self, lines: wrote.append(self.batch_id) or written(self, lines))
    made = []
    on_the_driver = windowed_batch.WindowedBatch._ids_on_driver
    monkeypatch.setattr(windowed_batch.WindowedBatch, "_ids_on_driver", (lambda self: (
        lambda got: made.append(got is not None) or got)(on_the_driver(self))) if on_driver else (lambda self: None))
    again = dict(p(2, 30 * SEC, "u2"), event_time=iso(T0 + 20 * SEC))  # e2 again, stamped earlier, in the same file
    batches = [
        [p(1, 1 * MIN + 500), p(2, 2 * MIN + 999, "u2"), again, p(3, 3 * MIN, "u3")],
        [p(4, 4 * MIN + 1), dict(p(1, 1 * MIN), event_time=iso(T0 + 3 * MIN)), p(5, 4 * MIN + 2, "u2"), p(4, 4 * MIN + 1)],
        [p(6, 40 * MIN, "u9"), p(7, 5 * MIN, "u3"), p(5, 41 * MIN, "u2"), p(8, 1 * MIN)],  # (e8: behind W_in)
    ]
    job = job_for(Tumbling(timedelta(minutes=5)), timedelta(minutes=10))
    stream(spark, lake_home, job, batches)

    ttl = int(job.dedup_ttl.total_seconds() * 1000)
    seen, w_in, expected = set(), None, []
    for events in batches:
        counted = {}
        for e in with_t(events):  # (in line order: one file per batch)
            if e["event_id"] not in seen and e["event_id"] not in counted:
                counted[e["event_id"]] = e["t_ms"]
        expected.append(sorted((t // 1000, (t if w_in is None else max(t, w_in)) + ttl) for t in counted.values()))
        seen |= set(counted)
        top = max(e["t_ms"] for e in with_t(events)) - DELAY
        w_in = top if w_in is None else max(w_in, top)
    store = Path(Layout(lake_home.checkpoint_dir(job.name)).store.removeprefix("file:"))
    got = []
    for batch in range(len(batches)):
        table = pq.read_table(store / str(batch) / "ids").to_pandas()
        assert not table.duplicated(["_h1", "_h2"]).any()
        got.append(sorted(zip(table["_b"].tolist(), table["_expires_ms"].tolist())))
    assert got == expected
    assert made == ([True] * len(batches) if on_driver else []), "each batch's ids took the path asked for"
    assert brought == (list(range(len(batches))) if large and on_driver else []), "the large path brought every id"
    assert wrote == ([0] if large and not on_driver else []), "the first large batch wrote its ids in its statistics"
