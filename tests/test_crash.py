"""SIGKILL a streaming job again and again while events keep arriving; the tables end up exactly
as an uninterrupted run's, in Iceberg and in Delta.

The job runs in a child process (``lakestream run purchase_metrics``, one file per micro-batch)
while a feeder moves files into the landing zone. The child is killed with SIGKILL 14 times: at
random moments (starting up, planning, inside a batch) and paused at named points of a batch —
after the quarantine table's commit (before the late and main tables'), after the late side
output's, after the main table's, before the engine state is written, and after it (before Spark
records the batch as committed) — and of a commit of side rows kept in the checkpoint outside a batch
(after its late table's commit, before the record's rewrite): side rows are committed every 2 s. Each time it is started again. An uninterrupted run reads the
same files one per batch; the oracle replays exactly that, so the final tables must equal it: no
window twice, none missing, every late event and quarantined line exactly once.

The keyed ``rolling_spend`` (each card's state in key files, timers) goes through the same ten kills;
its oracle replays the same one-file batches: every change row exactly once, every late event once.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests import oracle
from tests.conftest import SMALL, drop_job_tables
from tests.logs import excerpt

JOB = "purchase_metrics"
POINTS = [
    "committed:lake.quarantine.payments",
    "committed:lake.payments.purchase_metrics_late",
    "committed:lake.payments.purchase_metrics",
    "before-state",
    "after-state",
    # the commit of side rows kept in the checkpoint, outside a batch (``run.side``: at a start, an idle moment, a stop)
    "flushed:lake.payments.purchase_metrics_late",
    "before-flush-record",
]


def _child(home: Path, pause_at: str | None, pause_dir: Path, available_now: bool = False,
           job: str = JOB) -> subprocess.Popen:
    env = {**os.environ, "LAKESTREAM_PAUSE_DIR": str(pause_dir), "LAKESTREAM_PAUSE_SECONDS": "120"}
    env.pop("LAKESTREAM_PAUSE_AT", None)
    if pause_at:
        env["LAKESTREAM_PAUSE_AT"] = pause_at
    cmd = [sys.executable, "-m", "lakestream.cli", "--home", str(home), "run", job]
    if available_now:
        cmd.append("--available-now")
    log = open(home / "child.log", "a")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def _feeder(files: list[Path], landing: Path, stop: threading.Event) -> threading.Thread:
    def feed():
        for path in files:
            if stop.wait(1.5):
                return
            shutil.move(path, landing / path.name)

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    return thread


def _killed_again_and_again(home: Path, tmp_path: Path, job: str, points: list[str], times: int = 10) -> Path:
    """Feed the landing zone while ``job`` is SIGKILLed ``times`` times (half at random moments, half at the pause
    points, in turn), then run it to the end of its input; returns the landing folder."""
    from lakestream.generator import generate

    generate(SMALL, tmp_path / "staging", sources=("payments",))
    files = oracle.files_in_arrival_order(tmp_path / "staging" / "payments")
    landing = home / "landing" / "payments"
    landing.mkdir(parents=True)
    for path in files[:2]:
        shutil.move(path, landing / path.name)
    stop = threading.Event()
    feeder = _feeder(files[2:], landing, stop)
    rng = random.Random(20261122)
    pause_dir = tmp_path / "pauses"
    kills = []
    try:
        for n in range(times):
            point = points[n // 2 % len(points)] if n % 2 else None
            proc = _child(home, point, pause_dir, job=job)
            if point is None:
                time.sleep(rng.uniform(2.0, 10.0))  # wherever it is: starting, planning, mid-batch
                reached = "random"
            else:
                hit = _wait_for(lambda: any(p.name.startswith(point + "@") for p in pause_dir.glob("*")), 90)
                reached = point if hit else f"{point} (not reached, killed anyway)"
                for marker in pause_dir.glob("*"):
                    marker.unlink()
            assert proc.poll() is None, f"the child died on its own: see {home / 'child.log'}"
            _kill(proc)
            kills.append(reached)
        feeder.join(timeout=120)
    finally:
        stop.set()
    for path in files[2:]:  # whatever the feeder did not move yet arrives now
        if path.exists():
            shutil.move(path, landing / path.name)
    final = _child(home, None, pause_dir, available_now=True, job=job)
    assert final.wait(timeout=600) == 0, excerpt(home / "child.log")

    print("kills:", kills)
    assert len(kills) == times
    assert sum(1 for k in kills if "not reached" not in k and k != "random") >= 3, kills
    return landing


def _home(tmp_path: Path, warehouse: Path, fmt: str, job: str, extra: str = "") -> Path:
    home = tmp_path / "home"
    home.mkdir()
    # Snapshots expire after every batch (a retention of a millisecond): a replayed batch must still find the
    # commits it made before the kill.
    (home / "lakestream.yaml").write_text(
        f"warehouse: {warehouse}\nformat: {fmt}\nspark: {{shuffle_partitions: 2}}\n"
        f"iceberg: {{snapshot_retention: 1ms, expire_every: 0s}}\n"
        f"jobs: {{{job}: {{max_files_per_trigger: 1, trigger_interval: 300ms{extra}}}}}\n"
    )
    return home


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["iceberg", "delta"])
def test_sigkill_at_random_moments_never_duplicates_or_loses_a_row(spark, warehouse, tmp_path, fmt):
    drop_job_tables(spark)
    # Side rows are committed every 2 s (in a batch, or outside one while the stream idles, starts or stops): kills
    # land in both kinds of commit, and while rows are kept in the checkpoint.
    home = _home(tmp_path, warehouse, fmt, JOB, extra=", side_outputs_every: 2s")
    landing = _killed_again_and_again(home, tmp_path, JOB, POINTS, times=14)
    truth = oracle.replay_stream([oracle.read_lines(p) for p in oracle.files_in_arrival_order(landing)])
    windows, late, quarantine = _tables(spark, fmt, home, warehouse)
    assert windows == truth.closed  # _tables fails on a duplicate window
    assert sorted(late) == sorted(truth.late_ids)
    assert quarantine == truth.invalid_lines


def _tables(spark, fmt: str, home: Path, warehouse: Path):
    from decimal import Decimal

    if fmt == "iceberg":
        main = [r.asDict() for r in spark.table("lake.payments.purchase_metrics").collect()]
        late = [r.event_id for r in spark.table("lake.payments.purchase_metrics_late").collect()]
        quarantine = [r.occurrences for r in spark.table("lake.quarantine.payments").collect()]
    else:
        from deltalake import DeltaTable

        delta = home / "delta"
        main = DeltaTable(str(delta / "payments" / "purchase_metrics")).to_pyarrow_table().to_pylist()
        late = [r["event_id"] for r in DeltaTable(str(delta / "payments" / "purchase_metrics_late")).to_pyarrow_table().to_pylist()]
        quarantine = [r["occurrences"] for r in DeltaTable(str(delta / "quarantine" / "payments")).to_pyarrow_table().to_pylist()]
    windows = {}
    for r in main:
        key = (r["user_id"], int(r["window_start"].timestamp() * 1000))
        assert key not in windows, f"duplicate window {key}"
        windows[key] = (r["event_count"], r["approved_count"], r["declined_count"], Decimal(r["amount_sum"]))
    assert len(late) == len(set(late)), "a late event was written twice"
    return windows, late, sum(quarantine)


KEYED_POINTS = [
    "committed:lake.payments.rolling_spend",
    "committed:lake.payments.rolling_spend_late",
    "before-state",
    "after-state",
]


@pytest.mark.slow
def test_a_keyed_stream_sigkilled_at_random_moments_never_duplicates_or_loses_a_row(spark, warehouse, tmp_path):
    """rolling_spend (keyed state per card in key files, event-time timers 24 h after each payment): killed
    ten times while files arrive, every output row exactly once, as the oracle replays the batches."""
    from tests import oracle_jobs as oj

    drop_job_tables(spark)
    job = "rolling_spend"
    home = _home(tmp_path, warehouse, "iceberg", job)
    landing = _killed_again_and_again(home, tmp_path, job, KEYED_POINTS)
    expected, late = oj.rolling_spend_streamed(landing.parent, 1)
    got = [tuple(r) for r in spark.sql(oj.ROLLING_SPEND_ROWS).collect()]
    assert len(got) == len(set(got)), "a row was written twice"
    assert set(got) == expected and expected
    assert sorted(r.event_id for r in spark.table("lake.payments.rolling_spend_late").collect()) == sorted(late)
    assert list(home.rglob("keys/*/*.parquet")), "the keys' state is in key files"
