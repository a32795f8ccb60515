"""The five jobs of the event-time issue, each against its independent oracle on generated data
that contains the pattern it detects: as a stream (K files per micro-batch) and as its bounded twin.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import pytest

from batch.backfill import backfill
from batch.bounded import compute
from lakestream.generator import GeneratorConfig, generate
from streaming.project import get_job
from streaming.run.runner import run_stream
from streaming.io.tables import job_sinks
from tests import oracle, oracle_jobs as oj
from tests.conftest import drop_job_tables, settings_for
from tests.oracle_windows import Win, bounded_windows, replay_windows

K = 5  # files (minutes of arrivals) per micro-batch and source
MIN = 60_000
DELAY = 5_000

BUSY = GeneratorConfig(seed=11, duration=timedelta(minutes=25), rate=10.0, users=60, late_fraction=0.02,
                       late_min=timedelta(minutes=1), late_max=timedelta(minutes=8), duplicate_fraction=0.01,
                       malformed_fraction=0.005)
# Sparse activity over 90 minutes, so that 30-minute sessions close within the stream.
SPARSE = GeneratorConfig(seed=12, duration=timedelta(minutes=90), rate=1.0, users=400, late_fraction=0.03,
                         late_min=timedelta(minutes=2), late_max=timedelta(minutes=15), duplicate_fraction=0.01,
                         malformed_fraction=0.005)


def _lake(tmp_path_factory, cfg, name):
    settings = settings_for(tmp_path_factory.mktemp(name))
    generate(cfg, settings.landing)
    return settings


@pytest.fixture(scope="module")
def busy(tmp_path_factory):
    return _lake(tmp_path_factory, BUSY, "busy")


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    return _lake(tmp_path_factory, SPARSE, "sparse")


def stream(spark, settings, name: str, k: int = K):
    drop_job_tables(spark)
    settings = settings.with_job(name, max_files_per_trigger=k)
    job = get_job(name, settings)
    report = run_stream(spark, settings, job, available_now=True, progress=None, install_signal_handlers=False)
    return job, report


def bounded(spark, settings, job, days: int = 1):
    start = BUSY.start
    backfill(spark, settings, job, start, start + timedelta(days=days), progress=None, force=True)


def rows(spark, sql: str) -> list[tuple]:
    return [tuple(r) for r in spark.sql(sql).collect()]


def late_ids(spark, job) -> list[str]:
    return sorted(r[0] for r in rows(spark, f"SELECT event_id FROM {job.late_sink.name}"))


# -- windowed jobs ------------------------------------------------------------------------

def declines(events):
    return {"declined": len(events), "first": min(e["t_ms"] for e in events), "last": max(e["t_ms"] for e in events)}


def test_decline_velocity_alerts_on_more_than_five_declines_in_ten_sliding_minutes(spark, busy):
    job, report = stream(spark, busy, "decline_velocity")
    batched = oj.batches(Path(busy.landing), ["payments"], K)
    truth = replay_windows(batched, Win("sliding", size=10 * MIN, every=MIN), delay=DELAY, lateness=2 * MIN,
                           key=lambda e: e["user_id"], measure=declines, having=lambda r: r["declined"] > 5,
                           keep=lambda e: e["status"] == "DECLINED")
    sql = ("SELECT user_id, unix_millis(window_start), unix_millis(window_end), declined, unix_millis(first_decline), "
           f"unix_millis(last_decline) FROM {job.sink.name}")
    expected = {(k[0], k[1], v["window_end"], v["declined"], v["first"], v["last"]) for k, v in truth.table.items()}
    assert set(rows(spark, sql)) == expected and len(expected) > 20
    assert late_ids(spark, job) == sorted(i for i, *_ in truth.late) and truth.late
    assert report.stats.rows_written == truth.writes > len(expected), "some alerts were corrected within lateness"

    bounded(spark, busy, job)
    events = oj.dedup([e for b in batched for e in b])
    want = bounded_windows(events, Win("sliding", size=10 * MIN, every=MIN), key=lambda e: e["user_id"],
                           measure=declines, having=lambda r: r["declined"] > 5, keep=lambda e: e["status"] == "DECLINED")
    in_day = {(k[0], k[1], v["window_end"], v["declined"], v["first"], v["last"]) for k, v in want.items()
              if k[1] >= int(BUSY.start.timestamp() * 1000)}
    got = {r for r in rows(spark, sql) if r[1] >= int(BUSY.start.timestamp() * 1000)}
    assert got == in_day


def sessions(events):
    payments = [e for e in events if e["source"] == "payments"]
    return {"events": len(events), "logins": len(events) - len(payments), "payments": len(payments),
            "total": sum((e["amount"] for e in payments), Decimal("0")), "last": max(e["t_ms"] for e in events)}


SESSIONS_SQL = ("SELECT user_id, unix_millis(window_start), unix_millis(window_end), events, logins, payments, "
                "payments_total, unix_millis(last_event) FROM {table}")


def sessions_truth(settings):
    """(stream oracle, the stream's expected rows, the bounded twin's expected rows) of user_sessions."""
    batched = oj.batches(Path(settings.landing), ["logins", "payments"], 20)
    truth = replay_windows(batched, Win("session", gap=30 * MIN), delay=DELAY, lateness=10 * MIN,
                           key=lambda e: e["user_id"], measure=sessions)
    want = bounded_windows(oj.dedup([e for b in batched for e in b]), Win("session", gap=30 * MIN),
                           key=lambda e: e["user_id"], measure=sessions)

    def as_rows(table):
        return {(k[0], k[1], v["window_end"], v["events"], v["logins"], v["payments"], v["total"], v["last"])
                for k, v in table.items()}

    return truth, as_rows(truth.table), as_rows(want)


def test_user_sessions_merge_logins_and_payments_with_a_thirty_minute_gap(spark, sparse):
    job, report = stream(spark, sparse, "user_sessions", k=20)
    truth, expected, bounded_expected = sessions_truth(sparse)
    sql = SESSIONS_SQL.format(table=job.sink.name)
    assert set(rows(spark, sql)) == expected and len(expected) > 50
    assert late_ids(spark, job) == sorted(i for i, *_ in truth.late)
    assert report.stats.rows_written == truth.writes and report.stats.rows_deleted == truth.deletes

    bounded(spark, sparse, job)
    assert set(rows(spark, sql)) == bounded_expected


def test_user_sessions_on_delta_day_partitioned_tables_equal_the_same_oracle(spark, sparse, tmp_path):
    """Merged sessions are deletes plus upserts: the same job on Delta (delta-rs merges into tables
    partitioned by a generated day column), stream and bounded twin, against the same oracle."""
    settings = replace(sparse, format="delta", checkpoints=str(tmp_path / "checkpoints"),
                       delta_root=str(tmp_path / "delta"))
    job, report = stream(spark, settings, "user_sessions", k=20)
    truth, expected, bounded_expected = sessions_truth(settings)
    sinks = job_sinks(spark, settings, job, create=False)

    def table_rows():
        sinks.main.read().createOrReplaceTempView("delta_user_sessions")
        return set(rows(spark, SESSIONS_SQL.format(table="delta_user_sessions")))

    assert table_rows() == expected and len(expected) > 50
    assert sorted(r.event_id for r in sinks.late.read().collect()) == sorted(i for i, *_ in truth.late)
    assert (report.stats.rows_written, report.stats.rows_deleted) == (truth.writes, truth.deletes)
    days = {datetime.fromtimestamp(r[1] / 1000, tz=timezone.utc).date().isoformat() for r in expected}
    folders = {p.name for p in Path(sinks.main.location()).iterdir() if p.name.startswith("window_start_day=")}
    assert {f.split("=", 1)[1] for f in folders} == days  # one partition per day of window start

    bounded(spark, settings, job)
    assert table_rows() == bounded_expected


# -- keyed jobs ---------------------------------------------------------------------------

def keyed(spark, settings, name, sources, keep, pattern, sql, days=1):
    """Stream: the pattern over the on-time elements up to the final watermark; bounded: over all."""
    job, report = stream(spark, settings, name)
    batched = oj.batches(Path(settings.landing), sources, K)
    on_time, late, watermark = oj.keyed_truth(batched, keep, DELAY)
    expected = pattern([e for e in on_time if e["t_ms"] <= watermark], watermark)
    assert set(rows(spark, sql)) == expected and expected
    assert late_ids(spark, job) == sorted(late)
    assert report.stats.late == len(late)
    # each late row names a landing file that holds its event and keeps the event's original fields (as the
    # landing line has them), although the job's transform selects its columns
    holding: dict[str, set] = {}
    original: dict[str, dict] = {}
    for source in sources:
        for path in oracle.files_in_arrival_order(Path(settings.landing) / source):
            for line in oracle.read_lines(path):
                e = oj.VALIDATORS[source](line)
                if e is not None:
                    holding.setdefault(e["event_id"], set()).add(path.name)
                    original[e["event_id"]] = json.loads(line)
    named = rows(spark, f"SELECT event_id, source_file, event FROM {job.late_sink.name}")
    assert named and all(f is not None and f.rsplit("/", 1)[-1] in holding[i] for i, f, _ in named), named[:5]
    for event_id, _, event in named:
        kept, line = json.loads(event), original[event_id]
        assert set(kept) == set(line), (kept, line)  # every declared field, not only the selected ones
        assert all(kept[k] == line[k] for k in ("event_id", "user_id", "card_id", "merchant_id", "status", "ip")
                   if k in line), (kept, line)

    # The bounded twin over the days: every output (a forced backfill would leave those after the stream's
    # watermark to the stream: keyed outputs have no key to upsert on, see test_forced_backfill).
    start = int(BUSY.start.timestamp() * 1000)
    twin = compute(spark, settings, job, start, start + days * 24 * 60 * MIN)
    try:
        twin.main.createOrReplaceTempView("keyed_twin")
        got = set(rows(spark, sql.replace(job.sink.name, "keyed_twin")))
    finally:
        twin.release()
    everything = pattern(oj.dedup([e for b in batched for e in b if keep(e)]), start + days * 24 * 60 * MIN - 1)
    assert got == everything
    return expected, everything


def test_large_amount_alerts_on_a_payment_ten_times_the_previous_one(spark, busy):
    sql = "SELECT card_id, event_id, previous_event_id FROM lake.fraud.large_amount_alerts"
    expected, _ = keyed(spark, busy, "large_amount_alerts", ["payments"], lambda e: True,
                        lambda events, until: oj.large_amounts(events), sql)
    assert len(expected) > 50


def test_rolling_spend_follows_each_cards_last_24_hours_including_expiries(spark, busy):
    sql = ("SELECT card_id, unix_millis(as_of), spend_24h, payments_24h, cause FROM lake.payments.rolling_spend")
    _, everything = keyed(spark, busy, "rolling_spend", ["payments"], lambda e: e["status"] == "APPROVED",
                          oj.rolling_spend, sql, days=2)
    assert {r[4] for r in everything} == {"payment", "expiry"}  # the second day holds the expiries


def test_suspicious_logins_after_three_failures_and_a_success_within_five_minutes(spark, busy):
    sql = ("SELECT user_id, event_id, failed_count, unix_millis(first_failure), unix_millis(last_failure) "
           "FROM lake.fraud.suspicious_logins")
    expected, _ = keyed(spark, busy, "suspicious_logins", ["logins"], lambda e: True,
                        lambda events, until: oj.suspicious_logins(events), sql)
    assert len(expected) > 5
