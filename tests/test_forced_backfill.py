"""A forced backfill beside a stream that holds windows open: no window is ever in the table twice, the stream's
later writes win, and a window written twice anyway is an unexplained difference for reconciliation."""

from __future__ import annotations

import shutil
import threading
import time
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

from batch.backfill import backfill
from batch.reconcile import reconcile
from lakestream.generator import generate
from streaming.project import get_job
from streaming.run.runner import run_stream
from tests import oracle
from tests.conftest import SMALL
from tests.test_purchase_metrics import table_windows

JOB = "purchase_metrics"
K = 3
DAY = SMALL.start
NEXT_DAY = SMALL.start + timedelta(days=1)


def _staged(settings, tmp_path) -> tuple[Path, list[Path]]:
    generate(SMALL, tmp_path / "staging", sources=("payments",))
    landing = Path(settings.landing_dir("payments"))
    landing.mkdir(parents=True, exist_ok=True)
    return landing, oracle.files_in_arrival_order(tmp_path / "staging" / "payments")


def _arrive(files, landing) -> None:
    for p in files:
        shutil.move(p, landing / p.name)


def _bounded(landing: Path) -> dict:
    frame = oracle.bounded_windows(landing)
    return {(r.user_id, int(r.window_start_ms)): (r.event_count, r.approved_count, r.declined_count,
                                                   Decimal(r.amount_sum)) for r in frame.itertuples()}


def test_a_forced_backfill_over_a_stopped_streams_open_windows_is_upserted_when_the_stream_resumes(spark, lake,
                                                                                                   tmp_path):
    settings = lake.with_job(JOB, max_files_per_trigger=K)
    job = get_job(JOB, settings)
    landing, files = _staged(settings, tmp_path)
    half = len(files) // 2
    _arrive(files[:half], landing)
    first = run_stream(spark, settings, job, available_now=True, progress=None, install_signal_handlers=False)
    open_at_backfill = first.totals.watermark_out_ms  # windows ending after it are still open in the stream
    said = []
    backfill(spark, settings, job, DAY, NEXT_DAY, progress=said.append, force=True)
    backfilled = _bounded(landing)  # what the backfill wrote: every window of the files there
    assert any(ws + oracle.WINDOW_MS > open_at_backfill for _, ws in backfilled), "the backfill wrote open windows"

    _arrive(files[half:], landing)
    run_stream(spark, settings, job, available_now=True, progress=None, install_signal_handlers=False)

    stream = oracle.replay_stream([[line for p in oracle.files_in_arrival_order(landing)[i:i + K]
                                    for line in oracle.read_lines(p)] for i in range(0, len(files), K)])
    table = table_windows(spark)  # fails on a window in the table twice
    for key, value in table.items():  # a window the stream fired after the backfill holds the stream's value
        fired_later = key[1] + oracle.WINDOW_MS > open_at_backfill and key in stream.closed
        assert value == (stream.closed[key] if fired_later else backfilled[key]), key
    assert set(table) == set(backfilled) | set(stream.closed)
    report = reconcile(spark, settings, job, DAY, NEXT_DAY, progress=None, record=False)
    assert report.unexplained == 0, report.examples
    assert any("stream is stopped" in line and "upserts them when it resumes" in line for line in said), said


def test_a_forced_backfill_beside_a_running_stream_leaves_it_the_windows_it_holds_open(spark, lake, tmp_path):
    settings = lake.with_job(JOB, max_files_per_trigger=K, trigger_interval=timedelta(seconds=1))
    job = get_job(JOB, settings)
    landing, files = _staged(settings, tmp_path)
    half = len(files) // 2
    _arrive(files[:half], landing)
    stop, errors = threading.Event(), []

    def streaming():
        try:
            run_stream(spark, settings, job, available_now=False, progress=None, install_signal_handlers=False,
                       stop_event=stop)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    runner = threading.Thread(target=streaming, daemon=True)
    runner.start()
    commits = Path(settings.checkpoint_dir(JOB)) / "commits"
    deadline = time.monotonic() + 240
    while not (commits.is_dir() and len([p for p in commits.iterdir() if p.name.isdigit()]) >= -(-half // K)):
        assert time.monotonic() < deadline and runner.is_alive(), errors
        time.sleep(0.5)
    said = []
    backfill(spark, settings, job, DAY, NEXT_DAY, progress=said.append, force=True)
    _arrive(files[half:], landing)
    deadline = time.monotonic() + 240
    while len([p for p in commits.iterdir() if p.name.isdigit()]) < -(-len(files) // K):
        assert time.monotonic() < deadline and runner.is_alive(), errors
        time.sleep(0.5)
    stop.set()
    runner.join(timeout=120)
    assert not errors, errors
    table = table_windows(spark)  # fails on a window in the table twice
    assert table  # (its values: the backfill's for the windows it wrote, the stream's for those it left)
    report = reconcile(spark, settings, job, DAY, NEXT_DAY, progress=None, record=False)
    assert report.unexplained == 0, report.examples
    assert any("left to the running stream" in line for line in said), said


def test_reconciliation_fails_on_a_window_the_stream_table_holds_twice(spark, small_landing):
    settings = small_landing.with_job(JOB, max_files_per_trigger=6)
    job = get_job(JOB, settings)
    run_stream(spark, settings, job, available_now=True, progress=None, install_signal_handlers=False)
    assert reconcile(spark, settings, job, DAY, NEXT_DAY, progress=None, record=False).unexplained == 0
    spark.sql(f"INSERT INTO {job.sink.name} SELECT * FROM {job.sink.name} ORDER BY window_start LIMIT 1")
    report = reconcile(spark, settings, job, DAY, NEXT_DAY, progress=None, record=False)
    assert report.unexplained == 1 and "written 2 times by the stream" in report.examples[0]


def test_run_with_flush_writes_the_windows_still_open_and_a_later_run_corrects_them_exactly_once(spark, lake, tmp_path):
    """``lakestream run --available-now --flush``: at the end of input every window is in the table (Flink's end
    of bounded input), and a later run over more input corrects the flushed windows instead of adding them again."""
    from batch.backfill import final_horizon_ms
    from lakestream.cli import flush

    settings = lake.with_job(JOB, max_files_per_trigger=K)
    job = get_job(JOB, settings)
    landing, files = _staged(settings, tmp_path)
    half = len(files) // 2
    _arrive(files[:half], landing)
    run_stream(spark, settings, job, available_now=True, progress=None, install_signal_handlers=False)
    horizon = final_horizon_ms(spark, settings, job)
    said = flush(spark, settings, job)
    assert said.startswith("flushed the windows still open"), said
    # the windows the stream wrote, and every window it held open as the bounded twin computes it, each once
    stream = oracle.replay_stream([[line for p in oracle.files_in_arrival_order(landing)[i:i + K]
                                    for line in oracle.read_lines(p)] for i in range(0, half, K)])
    flushed = {k: v for k, v in _bounded(landing).items() if k[1] >= horizon}
    assert flushed and table_windows(spark) == {**flushed, **stream.closed}

    _arrive(files[half:], landing)
    run_stream(spark, settings, job, available_now=True, progress=None, install_signal_handlers=False)
    flush(spark, settings, job)
    stream = oracle.replay_stream([[line for p in oracle.files_in_arrival_order(landing)[i:i + K]
                                    for line in oracle.read_lines(p)] for i in range(0, len(files), K)])
    horizon = final_horizon_ms(spark, settings, job)
    bounded = _bounded(landing)
    expected = {**{k: v for k, v in bounded.items() if k[1] >= horizon}, **stream.closed}
    assert table_windows(spark) == expected  # (fails on a window in the table twice)
    assert flush(spark, settings, job).startswith("flushed")  # a flush again changes nothing
    assert table_windows(spark) == expected
