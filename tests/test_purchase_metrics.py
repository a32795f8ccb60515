"""purchase_metrics against independent oracles: stream, bounded twin, quarantine, restart."""

from __future__ import annotations

import shutil
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from batch.backfill import backfill
from streaming.time import epoch_ms
from streaming.project import get_job
from streaming.run.runner import run_stream
from tests import oracle
from tests.conftest import SMALL

JOB = "purchase_metrics"


def table_windows(spark, name="lake.payments.purchase_metrics") -> dict[tuple[str, int], tuple]:
    rows = spark.sql(
        f"SELECT user_id, unix_millis(window_start) AS ws, unix_millis(window_end) AS we, event_count, "
        f"approved_count, declined_count, amount_sum FROM {name}"
    ).collect()
    out = {}
    for r in rows:
        key = (r.user_id, r.ws)
        assert key not in out, f"duplicate window {key}"
        assert r.we - r.ws == oracle.WINDOW_MS
        out[key] = (r.event_count, r.approved_count, r.declined_count, Decimal(r.amount_sum))
    return out


K = 3  # files per micro-batch: the watermark moves between batches, so late events occur


def k_files_per_batch(landing: Path) -> list[list[str]]:
    files = oracle.files_in_arrival_order(landing)
    return [[line for p in files[i:i + K] for line in oracle.read_lines(p)] for i in range(0, len(files), K)]


def run_k_files_per_trigger(spark, settings):
    settings = settings.with_job(JOB, max_files_per_trigger=K)
    return run_stream(spark, settings, get_job(JOB, settings), available_now=True, progress=None)


@dataclass
class Streamed:
    """One stream run (K files per micro-batch) over SMALL, its oracle, and its tables as Python data."""

    landing: Path
    truth: oracle.StreamTruth
    report: object
    windows: dict
    late: list
    quarantine: list


@pytest.fixture(scope="module")
def streamed(spark, tmp_path_factory) -> Streamed:
    from lakestream.generator import generate

    from tests.conftest import drop_job_tables, settings_for

    drop_job_tables(spark)
    settings = settings_for(tmp_path_factory.mktemp("streamed"))
    generate(SMALL, settings.landing, sources=("payments",))
    landing = Path(settings.landing_dir("payments"))
    report = run_k_files_per_trigger(spark, settings)
    return Streamed(
        landing=landing,
        truth=oracle.replay_stream(k_files_per_batch(landing)),
        report=report,
        windows=table_windows(spark),
        late=spark.sql(
            "SELECT event_id, user_id, unix_millis(window_start) AS ws, window_end, watermark_ms, late_by_ms, event_time, "
            "event, source_file FROM lake.payments.purchase_metrics_late"
        ).collect(),
        quarantine=spark.sql("SELECT raw_line, reason, occurrences, source_file FROM lake.quarantine.payments").collect(),
    )


def test_stream_emits_exactly_the_closed_windows_and_sends_late_events_to_the_side_output(streamed):
    truth, report, late = streamed.truth, streamed.report, streamed.late
    assert truth.late_ids, "the input must contain late events for this test to mean anything"
    assert report.batches == -(-len(oracle.files_in_arrival_order(streamed.landing)) // K)
    assert streamed.windows == truth.closed
    assert sorted(r.event_id for r in late) == sorted(truth.late_ids)
    # every late row missed its window: the window had closed when the event arrived
    assert all(epoch_ms(r.window_end) <= r.watermark_ms for r in late)
    assert all(r.late_by_ms == r.watermark_ms - epoch_ms(r.event_time) for r in late)
    assert report.stats.late == len(truth.late_ids)
    assert report.totals.watermark_out_ms == truth.watermark_ms


def test_late_rows_carry_the_original_event_and_its_file(streamed):
    """Each late row's ``event`` is the payment as it arrived (its fields, from the first file that delivered it)
    and ``source_file`` that file: read from the landing files, not from the engine."""
    import json

    first: dict[str, tuple[str, dict]] = {}
    for path in oracle.files_in_arrival_order(streamed.landing):
        for line in oracle.read_lines(path):
            if (fields := oracle.validate(line)) is not None:
                first.setdefault(str(fields["event_id"]), (path.name, fields))
    assert streamed.late
    for r in streamed.late:
        name, fields = first[r.event_id]
        assert r.source_file.endswith("/" + name), (r.event_id, r.source_file, name)
        event = json.loads(r.event)
        assert event["event_id"] == r.event_id and event["user_id"] == fields["user_id"] == r.user_id
        assert Decimal(str(event["amount"])) == fields["amount"]
        assert event["status"] == fields["status"]


def test_bounded_twin_equals_the_batch_oracle_and_rerunning_changes_nothing(spark, small_landing):
    start, end = SMALL.start, SMALL.start + timedelta(days=1)
    job = get_job(JOB, small_landing)
    expected = oracle.bounded_windows(Path(small_landing.landing_dir("payments")))
    expected = {
        (r.user_id, r.window_start_ms): (r.event_count, r.approved_count, r.declined_count, r.amount_sum)
        for r in expected.itertuples()
    }

    first = backfill(spark, small_landing, job, start, end, progress=lambda *_: None)
    assert table_windows(spark) == expected
    assert first.stats.late == 0
    files_before = {r.file_path for r in spark.sql("SELECT file_path FROM lake.payments.purchase_metrics.files").collect()}

    backfill(spark, small_landing, job, start, end, progress=lambda *_: None)
    assert table_windows(spark) == expected
    files_after = spark.sql("SELECT file_path FROM lake.payments.purchase_metrics.files").count()
    assert files_after == len(files_before), "a re-run replaces the range, it does not add to it"


def test_reconciliation_law_stream_plus_late_side_output_equals_bounded(streamed):
    """For every window: closed stream result + late events of that window = bounded result."""
    late_counts = Counter((r.user_id, r.ws) for r in streamed.late)
    bounded = oracle.bounded_windows(streamed.landing)
    checked = 0
    for r in bounded.itertuples():
        key = (r.user_id, r.window_start_ms)
        if key[1] + oracle.WINDOW_MS > streamed.truth.watermark_ms:
            continue  # still open in the stream
        assert streamed.windows.get(key, (0,))[0] + late_counts.get(key, 0) == r.event_count, key
        checked += 1
    assert checked >= 50 and late_counts


def test_bounded_twin_over_a_partial_day_replaces_only_that_range(spark, small_landing):
    job = get_job(JOB, small_landing)
    whole = (SMALL.start, SMALL.start + timedelta(days=1))
    backfill(spark, small_landing, job, *whole, progress=lambda *_: None)
    spark.sql("UPDATE lake.payments.purchase_metrics SET event_count = -1")  # spoil every row
    lo, hi = SMALL.start + timedelta(minutes=5), SMALL.start + timedelta(minutes=10)

    backfill(spark, small_landing, job, lo, hi, progress=lambda *_: None)

    expected = oracle.bounded_windows(Path(small_landing.landing_dir("payments")), epoch_ms(lo), epoch_ms(hi))
    rows = table_windows(spark)
    inside = {k: v for k, v in rows.items() if epoch_ms(lo) <= k[1] < epoch_ms(hi)}
    assert {k: v[0] for k, v in inside.items()} == {
        (r.user_id, r.window_start_ms): r.event_count for r in expected.itertuples()
    }
    assert all(v[0] == -1 for k, v in rows.items() if k not in inside), "rows outside the range are untouched"


def test_every_line_is_either_an_event_or_quarantined_with_a_reason(streamed):
    lines = [line for p in oracle.files_in_arrival_order(streamed.landing) for line in oracle.read_lines(p)]
    invalid = [line for line in lines if oracle.validate(line) is None]
    assert invalid
    report, rows = streamed.report, streamed.quarantine
    assert sum(r.occurrences for r in rows) == len(invalid)
    assert sorted(r.raw_line for r in rows for _ in range(r.occurrences)) == sorted(invalid)
    assert all(r.reason and r.source_file.endswith(".jsonl") for r in rows)
    reasons = {r.reason.split(" ")[0] for r in rows}
    assert {"malformed", "missing", "invalid"} <= reasons
    assert report.stats.lines == len(lines)
    assert report.stats.lines == report.stats.quarantined + report.stats.events + report.stats.duplicates


def test_restart_continues_where_it_left_off_without_duplicate_windows(spark, lake, tmp_path):
    from lakestream.generator import generate

    staging = tmp_path / "staging"
    generate(SMALL, staging, sources=("payments",))
    files = oracle.files_in_arrival_order(staging / "payments")
    landing = Path(lake.landing_dir("payments"))
    landing.mkdir(parents=True)
    half = len(files) // 2 // K * K  # a whole number of batches, as the oracle groups them
    for p in files[:half]:
        shutil.move(p, landing / p.name)
    first = run_k_files_per_trigger(spark, lake)
    assert first.batches == half // K
    for p in files[half:]:
        shutil.move(p, landing / p.name)

    second = run_k_files_per_trigger(spark, lake)

    assert second.batches == -(-(len(files) - half) // K)
    truth = oracle.replay_stream(k_files_per_batch(landing))
    assert table_windows(spark) == truth.closed  # table_windows also fails on a duplicate window
    late = spark.sql("SELECT event_id FROM lake.payments.purchase_metrics_late").collect()
    assert sorted(r.event_id for r in late) == sorted(truth.late_ids)


class Crash(Exception):
    pass


def _crash_once(spark, settings, job, point: str) -> int:
    """Run the stream until ``point`` of a batch from the third on raises; returns that batch's id."""
    hits: list[int] = []

    def crash(at: str, batch_id: int) -> None:
        if at == point and not hits and batch_id >= 2:  # after a window closed and a late event came
            hits.append(batch_id)
            raise Crash(f"injected crash at {at} in batch {batch_id}")

    with pytest.raises(Exception, match="injected crash"):
        run_stream(spark, settings, job, available_now=True, progress=None, fault=crash)
    assert hits
    return hits[0]


def _assert_windows_and_late_rows_as_the_oracle_says(spark, settings) -> oracle.StreamTruth:
    truth = oracle.replay_stream(k_files_per_batch(Path(settings.landing_dir("payments"))))
    assert table_windows(spark) == truth.closed  # fails on any duplicate window
    late = spark.sql("SELECT event_id FROM lake.payments.purchase_metrics_late").collect()
    assert sorted(r.event_id for r in late) == sorted(truth.late_ids)
    return truth


@pytest.mark.parametrize(
    "point",
    ["committed:lake.payments.purchase_metrics", "committed:lake.payments.purchase_metrics_late", "before-state"],
)
def test_a_batch_that_fails_between_commits_is_replayed_exactly_once(spark, small_landing, point):
    """Crash after some tables of a batch committed; the restart replays it without duplicates. (Side tables committed
    with every batch, so a batch's commits of them are among the points; kept side rows: test_side_outputs.)"""
    settings = small_landing.with_job(JOB, max_files_per_trigger=K, side_outputs_every=timedelta(0))
    job = get_job(JOB, settings)
    _crash_once(spark, settings, job, point)
    run_stream(spark, settings, job, available_now=True, progress=None)

    truth = _assert_windows_and_late_rows_as_the_oracle_says(spark, settings)
    quarantined = spark.sql("SELECT sum(occurrences) AS n FROM lake.quarantine.payments").first().n
    assert quarantined == truth.invalid_lines


def test_only_the_batch_an_earlier_run_left_unfinished_looks_for_its_commits(spark, small_landing, monkeypatch):
    """A run's own batches, its first included, are known to be new and write without looking their commits up in
    the tables; after a crash, the batch the dead run left unfinished looks them up (and is not doubled)."""
    from streaming.io.sinks.iceberg import IcebergSink

    looked: list[int] = []
    real = IcebergSink.is_committed

    def recording(self, commit):
        if not commit.app_id.endswith("~flush"):  # (a run's commit of kept side rows looks its own up: run.side)
            looked.append(commit.version)
        return real(self, commit)

    monkeypatch.setattr(IcebergSink, "is_committed", recording)
    settings = small_landing.with_job(JOB, max_files_per_trigger=K)
    job = get_job(JOB, settings)
    crashed = _crash_once(spark, settings, job, "before-state")  # (every table of the batch committed, no record)
    assert looked == []
    run_stream(spark, settings, job, available_now=True, progress=None)
    assert looked and set(looked) == {crashed}
    _assert_windows_and_late_rows_as_the_oracle_says(spark, settings)


def test_transform_runs_unchanged_on_a_streaming_frame(spark, small_landing):
    from pyspark.sql import functions as F

    from streaming.io.parse import parse

    job = get_job(JOB)
    raw = spark.readStream.format("text").load(small_landing.landing_dir("payments"))
    frame = job.transform(parse(raw.select("value", F.col("_metadata.file_path").alias("source_file")), job.source))
    assert frame.isStreaming
    assert {"user_id", "event_time", "approved", "declined", "amount"} <= set(frame.columns)
