"""Backfills (Delta), a backfill beside the live stream, the ownership rule, and reconciliation.

Expected values come from the oracle over the landing-zone files (``tests.oracle``).
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import Counter
from dataclasses import replace
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from batch.backfill import backfill, final_horizon_ms
from batch.reconcile import reconcile
from streaming.time import epoch_ms
from streaming.errors import OwnershipError
from lakestream.generator import generate
from streaming.project import get_job
from streaming.run.runner import run_stream
from streaming.io.tables import job_sinks
from tests import oracle
from tests.conftest import SMALL

JOB = "purchase_metrics"
DAY1 = SMALL.start
DAY2 = SMALL.start + timedelta(days=1)


def windows_of(frame) -> dict:
    out = {}
    for r in frame.collect():
        key = (r.user_id, epoch_ms(r.window_start))
        assert key not in out, f"duplicate window {key}"
        out[key] = (r.event_count, r.approved_count, r.declined_count, Decimal(r.amount_sum))
    return out


def bounded_oracle(landing: Path, lo, hi) -> dict:
    frame = oracle.bounded_windows(landing, epoch_ms(lo), epoch_ms(hi))
    return {(r.user_id, r.window_start_ms): (r.event_count, r.approved_count, r.declined_count, r.amount_sum)
            for r in frame.itertuples()}


def test_backfill_in_delta_equals_the_oracle_and_a_rerun_changes_nothing(spark, small_landing):
    from deltalake import DeltaTable

    settings = replace(small_landing, format="delta")
    job = get_job(JOB, settings)
    backfill(spark, settings, job, DAY1, DAY2, progress=None)
    sinks = job_sinks(spark, settings, job)
    expected = bounded_oracle(Path(settings.landing_dir("payments")), DAY1, DAY2)
    assert windows_of(sinks.main.read()) == expected
    files = len(DeltaTable(sinks.main.location()).file_uris())
    version = sinks.main.version()

    backfill(spark, settings, job, DAY1, DAY2, progress=None)
    assert windows_of(sinks.main.read()) == expected
    assert len(DeltaTable(sinks.main.location()).file_uris()) == files, "a re-run replaces, it does not add"
    assert sinks.main.version() == version + 1  # exactly one atomic commit for the range
    quarantined = sinks.quarantine["payments"].read().agg({"occurrences": "sum"}).first()[0]
    assert quarantined == sum(1 for p in oracle.files_in_arrival_order(Path(settings.landing_dir("payments")))
                              for line in oracle.read_lines(p) if oracle.validate(line) is None)


def test_a_backfill_whose_main_table_fails_beside_its_quarantine_commit_is_whole_when_run_again(spark, small_landing, monkeypatch):
    """The quarantine's commit runs beside the main table's pass. The main table's write fails: the backfill
    fails once the quarantine's commit has ended (the cache they share stays until then), and a second run
    leaves both tables equal to the oracle, no quarantined line twice."""
    from streaming.io.sinks.iceberg import IcebergSink

    job = get_job(JOB, small_landing)
    replace_range = IcebergSink.replace_range

    def failing(self, *args, **kwargs):
        raise RuntimeError("the main table's write failed")

    monkeypatch.setattr(IcebergSink, "replace_range", failing)
    with pytest.raises(RuntimeError, match="main table's write failed"):
        backfill(spark, small_landing, job, DAY1, DAY2, progress=None)
    sinks = job_sinks(spark, small_landing, job)
    assert sinks.main.read().count() == 0
    monkeypatch.setattr(IcebergSink, "replace_range", replace_range)
    backfill(spark, small_landing, job, DAY1, DAY2, progress=None)

    landing = Path(small_landing.landing_dir("payments"))
    assert windows_of(sinks.main.read()) == bounded_oracle(landing, DAY1, DAY2)
    invalid = [(p.name, line) for p in oracle.files_in_arrival_order(landing) for line in oracle.read_lines(p)
               if oracle.validate(line) is None]
    rows = sinks.quarantine["payments"].read().collect()
    assert len(rows) == len({(r.source_file, r.raw_line) for r in rows}), "a quarantined line twice"
    assert sorted((Path(r.source_file).name, r.raw_line, r.occurrences) for r in rows) == \
        sorted((name, line, n) for (name, line), n in Counter(invalid).items())


def test_a_backfill_refuses_windows_a_running_stream_still_owns_unless_forced_and_takes_a_stopped_ones(spark, small_landing):
    """While the stream runs (it holds the job's lease), a range past its final horizon is refused without
    ``force``; once it has stopped, the backfill writes the windows it holds open and says so (the stream
    upserts them when it resumes: see test_forced_backfill)."""
    from streaming.checkpoint.lease import Lease

    settings = small_landing.with_job(JOB, max_files_per_trigger=6)
    job = get_job(JOB, settings)
    run_stream(spark, settings, job, available_now=True, progress=None, install_signal_handlers=False)
    horizon = final_horizon_ms(spark, settings, job)
    assert epoch_ms(DAY1) < horizon < epoch_ms(DAY2)
    running = Lease(settings.checkpoint_dir(JOB), job=JOB).acquire("stream")
    try:
        with pytest.raises(OwnershipError, match=r"its stream \(running .*may still write windows starting after"):
            backfill(spark, settings, job, DAY1, DAY2, progress=None)
        said = []
        backfill(spark, settings, job, DAY1, DAY2, progress=said.append, force=True)
        assert any("forced: replacing" in line and "running stream" in line for line in said), said
    finally:
        running.release()
    said = []
    backfill(spark, settings, job, DAY1, DAY2, progress=said.append)  # stopped: no --force needed
    assert any("its stream is stopped; the windows of the range it still holds open are written now" in line
               for line in said), said
    expected = bounded_oracle(Path(settings.landing_dir("payments")), DAY1, DAY2)
    assert windows_of(job_sinks(spark, settings, job).main.read()) == expected


def test_a_backfill_beside_the_live_stream_keeps_both_writers_commits(spark, lake, tmp_path):
    """Day 1 is backfilled while the stream writes day 2 into the same tables: both finish, day 1
    holds the bounded result and day 2 the stream's."""
    settings = lake.with_job(JOB, max_files_per_trigger=1, trigger_interval=timedelta(milliseconds=200))
    job = get_job(JOB, settings)
    generate(SMALL, tmp_path / "day1", sources=("payments",))
    generate(replace(SMALL, seed=8, start=DAY2), tmp_path / "day2", sources=("payments",))
    landing = Path(settings.landing_dir("payments"))
    landing.mkdir(parents=True)
    day1 = oracle.files_in_arrival_order(tmp_path / "day1" / "payments")
    day2 = oracle.files_in_arrival_order(tmp_path / "day2" / "payments")
    for p in day1:
        shutil.move(p, landing / p.name)
    run_stream(spark, settings.with_job(JOB, max_files_per_trigger=3), job, available_now=True, progress=None,
               install_signal_handlers=False)

    stop, errors, reports = threading.Event(), [], []

    def stream():
        try:
            reports.append(run_stream(spark, settings, job, available_now=False, progress=None, stop_event=stop,
                                      install_signal_handlers=False))
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    runner = threading.Thread(target=stream, daemon=True)
    runner.start()
    fed = 0
    # Feed day 2 until the stream's watermark makes day 1 final; then backfill day 1 while the
    # rest of day 2 keeps arriving and streaming.
    while (final_horizon_ms(spark, settings, job) or 0) < epoch_ms(DAY2):
        assert fed < len(day2) and not errors, errors
        shutil.move(day2[fed], landing / day2[fed].name)
        fed += 1
        time.sleep(2.5)
    feeder_files = day2[fed:]

    def feed():
        for p in feeder_files:
            shutil.move(p, landing / p.name)
            time.sleep(1.0)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    backfill(spark, settings, job, DAY1, DAY2, progress=None)
    feeder.join(timeout=120)
    from streaming.checkpoint.inspect import inspect_checkpoint

    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        report = inspect_checkpoint(JOB, settings.checkpoint_dir(JOB), settings.landing_dir("payments"))
        if report.files_waiting == 0 and report.in_flight_batch is None and report.files_in_flight == 0:
            break
        assert not errors, errors
        time.sleep(1)
    stop.set()
    runner.join(timeout=120)
    assert not errors, errors

    sinks = job_sinks(spark, settings, job)
    table = windows_of(sinks.main.read())
    expected_day1 = bounded_oracle(landing, DAY1, DAY2)
    batches = [[line for p in day1[i:i + 3] for line in oracle.read_lines(landing / p.name)]
               for i in range(0, len(day1), 3)]
    batches += [oracle.read_lines(landing / p.name) for p in day2]
    truth = oracle.replay_stream(batches)
    expected_day2 = {k: v for k, v in truth.closed.items() if k[1] >= epoch_ms(DAY2)}
    assert {k: v for k, v in table.items() if k[1] < epoch_ms(DAY2)} == expected_day1
    assert {k: v for k, v in table.items() if k[1] >= epoch_ms(DAY2)} == expected_day2
    late = sinks.late.read().collect()
    assert not [r for r in late if r.window_start.timestamp() * 1000 < epoch_ms(DAY2)], "the backfill absorbed day 1's late events"
    day2_late = {i for i in truth.late_ids if i.startswith("p8-")}
    assert sorted(r.event_id for r in late) == sorted(day2_late)


def test_reconciliation_explains_late_and_in_flight_differences_and_finds_deleted_rows(spark, small_landing):
    from lakestream.cli import main

    settings = small_landing.with_job(JOB, max_files_per_trigger=3)
    job = get_job(JOB, settings)
    run_stream(spark, settings, job, available_now=True, progress=None, install_signal_handlers=False)
    clean = reconcile(spark, settings, job, DAY1, DAY2, progress=None)
    day = clean.days[0]
    assert clean.unexplained == 0 and day.late > 0 and day.in_flight > 0 and day.matching > 0
    assert day.compared == day.matching + day.late + day.in_flight

    sinks = job_sinks(spark, settings, job)
    # a streamed, final window that no late event touches: only damage can explain a difference there
    clean_rows = sinks.main.read().join(sinks.late.read().select("user_id", "window_start"), ["user_id", "window_start"],
                                        "left_anti").orderBy("user_id", "window_start").limit(2).collect()
    assert len(clean_rows) == 2
    for row in clean_rows:
        sinks.main.delete_where(f"user_id = '{row.user_id}' AND window_start = TIMESTAMP '{row.window_start}'")
    damaged = reconcile(spark, settings, job, DAY1, DAY2, progress=None)
    assert damaged.unexplained == 2
    assert all(any(r.user_id in e and "missing from the stream" in e for e in damaged.examples) for r in clean_rows)

    code = main(["--home", str(settings.home), "reconcile", JOB, "--start", "2026-11-20", "--end", "2026-11-21"])
    assert code == 1
    recorded = spark.sql("SELECT job, unexplained FROM lake.ops.reconciliation ORDER BY checked_at").collect()
    assert [r.unexplained for r in recorded][:2] == [0, damaged.unexplained]


def test_the_bounded_dedup_numbers_each_ids_deliveries_without_sorting_every_event_before_its_shuffle(
        spark, small_landing, monkeypatch):
    """A bounded run whose ids do not come to the driver (more input than ``DRIVER_LOOKUP_BYTES``) numbers each id's
    deliveries. Spark 3.5 turns the dedup's ``row_number() = 1`` into a top-1 per map partition: a sort of every event
    before the shuffle, which rare repeats leave with nothing to drop (~0.9 s of a 1M-event backfill). The
    session turns that off; the plan still keeps each id's first delivery by its window."""
    import streaming.windowed.batch as windowed_batch
    from batch.bounded import compute

    monkeypatch.setattr(windowed_batch, "DRIVER_LOOKUP_BYTES", 0)
    job = get_job(JOB, small_landing)
    result = compute(spark, small_landing, job, epoch_ms(DAY1), epoch_ms(DAY2))
    try:
        plan = result.main._jdf.queryExecution().optimizedPlan().toString()  # noqa: SLF001 - the plan Spark runs
    finally:
        result.release()
    assert "row_number()" in plan
    assert "WindowGroupLimit" not in plan


@pytest.mark.parametrize("driver", [True, False], ids=["ids-on-the-driver", "numbered-by-a-shuffle"])
def test_the_bounded_dedup_keeps_each_ids_first_delivery_whether_its_ids_come_to_the_driver_or_not(
        spark, small_landing, monkeypatch, driver):
    """A bounded run of no more than ``DRIVER_LOOKUP_BYTES`` of input brings its ids to the driver with its count job,
    which finds the later deliveries of each id: the events are the cached lines without them, with no shuffle or
    numbering of the events by id (the plan has no window function); a larger one numbers each id's deliveries. The
    windows and the duplicates counted equal the plain-Python oracle's over the landing files (each id's first delivery
    in arrival order) either way."""
    import streaming.windowed.batch as windowed_batch
    from batch.bounded import compute

    if not driver:
        monkeypatch.setattr(windowed_batch, "DRIVER_LOOKUP_BYTES", 0)
    job = get_job(JOB, small_landing)
    result = compute(spark, small_landing, job, epoch_ms(DAY1), epoch_ms(DAY2))
    try:
        plan = result.main._jdf.queryExecution().optimizedPlan().toString()  # noqa: SLF001 - the plan Spark runs
        got = windows_of(result.main)
        stats = result.final_stats()
    finally:
        result.release()
    assert ("row_number()" in plan) != driver
    landing = Path(small_landing.landing_dir("payments"))
    assert got == bounded_oracle(landing, DAY1, DAY2)
    valid = [e for f in oracle.files_in_arrival_order(landing) for e in map(oracle.validate, oracle.read_lines(f)) if e]
    assert stats.events + stats.duplicates == len(valid) and stats.duplicates == len(valid) - len({str(e["event_id"]) for e in valid}) > 0


def test_an_iceberg_merge_overtaken_by_another_writers_commit_is_retried_as_a_conflict():
    """Iceberg's MERGE (the backfill's late rows, beside a live stream) fails when the stream committed between
    its scan and its runtime filter; that is a conflict to retry, not a failure (seen in the test above)."""
    from streaming.io.sinks.base import is_conflict

    message = ("java.lang.IllegalStateException: Runtime file filtering is not possible: the table has been "
               "concurrently modified. Row-level operation scan snapshot ID: 7834456638948457883, current table "
               "snapshot ID: 1611405522571864318.")
    assert is_conflict(RuntimeError(message))
    assert not is_conflict(RuntimeError("java.lang.IllegalStateException: Cannot write to a closed writer"))
