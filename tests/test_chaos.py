"""An operator's bad day, with the CLI, on two jobs that read one source (purchase_metrics and
decline_velocity, one Spark application) while files keep landing:

1. the application is SIGKILLed (its whole process group) at a random moment, and again, once started anew, at
   a pause point inside a batch (after purchase_metrics' main commit): a crash loop;
2. while it is down, a savepoint of purchase_metrics is taken (the dead runner's lease is taken over);
3. once it runs again, a second ``run`` of purchase_metrics is refused in one line, and a forced backfill of
   the day runs beside the live stream, over windows it still holds open;
4. a landing file is copied in with a modification time ten days old;
5. the application is stopped; purchase_metrics is restored from its savepoint and runs to the end;
   decline_velocity runs to the end.

At the end every table equals what its oracle computes from the batches the final checkpoint records (the
files of each batch, from Spark's source log): no window twice, none lost, every late event and every
quarantined line once — each job's quarantine rows intact, whatever the other job's restore did — and every
refusal was one line.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from streaming.checkpoint.layout import numbered, source_log_entries, source_log_files
from tests import oracle
from tests import oracle_jobs as oj
from tests.conftest import SMALL, drop_job_tables
from tests.landing import MIN, payment
from tests.logs import excerpt
from tests.oracle_windows import Win, replay_windows

pytestmark = pytest.mark.slow

JOBS = ("purchase_metrics", "decline_velocity")
DAY = SMALL.start.date().isoformat()
NEXT_DAY = (SMALL.start + timedelta(days=1)).date().isoformat()


def _cli(home: Path, *args: str, env: dict | None = None, log: str = "cli.log", wait: bool = True):
    cmd = [sys.executable, "-m", "lakestream.cli", "--home", str(home), *args]
    out = open(home / log, "a")
    # A process left running writes its errors to the log too: a pipe nobody reads blocks the process once it
    # holds 64 KiB (Spark's log and Python's warnings go to stderr), and an error the test never sees explains no failure.
    proc = subprocess.Popen(cmd, env=env or dict(os.environ), stdout=out,
                            stderr=subprocess.PIPE if wait else subprocess.STDOUT, text=True, start_new_session=True)
    if not wait:
        return proc
    _, stderr = proc.communicate(timeout=600)
    return proc.returncode, stderr


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


def _commits(home: Path, job: str) -> int:
    folder = home / "checkpoints" / job / "commits"
    return len([p for p in folder.iterdir() if p.name.isdigit()]) if folder.is_dir() else 0


def _batches(home: Path, job: str) -> list[list[str]]:
    """The lines of each committed batch of ``job``'s final checkpoint, in batch order (Spark's source log)."""
    checkpoint = home / "checkpoints" / job
    last = numbered([p.name for p in (checkpoint / "commits").iterdir()])[-1]
    log = checkpoint / "sources" / "0"
    files: dict[int, list[str]] = {}
    for name in source_log_files([p.name for p in log.iterdir()]):
        for entry in source_log_entries((log / name).read_text(), name, int(name.split(".")[0])):
            if entry.batch_id <= last:
                files.setdefault(entry.batch_id, []).append(entry.path.removeprefix("file:"))
    return [[line for path in sorted(files[b]) for line in oracle.read_lines(Path(path))] for b in sorted(files)]


def _read(home: Path, fmt: str, warehouse: Path, spark):
    """Each table of the two jobs as Python rows (the test session's Spark reads Iceberg; delta-rs reads Delta)."""
    tables = {"pm": "payments/purchase_metrics", "pm_late": "payments/purchase_metrics_late",
              "dv": "fraud/decline_alerts", "dv_late": "fraud/decline_alerts_late", "q": "quarantine/payments"}
    out = {}
    for name, path in tables.items():
        if fmt == "iceberg":
            out[name] = [r.asDict() for r in spark.table("lake." + path.replace("/", ".")).collect()]
        else:
            from deltalake import DeltaTable

            out[name] = DeltaTable(str(home / "delta" / path)).to_pyarrow_table().to_pylist()
    return out


def _one_line(code: int, stderr: str, phrase: str) -> None:
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("lakestream: error:") and phrase in lines[0], stderr


@pytest.mark.parametrize("fmt", ["iceberg", "delta"])
def test_an_operators_bad_day_ends_with_every_table_as_its_oracle_says(spark, warehouse, tmp_path, fmt):
    from lakestream.generator import generate

    drop_job_tables(spark)
    home = tmp_path / "home"
    home.mkdir()
    (home / "lakestream.yaml").write_text(
        f"warehouse: {warehouse}\nformat: {fmt}\nspark: {{shuffle_partitions: 2}}\njobs:\n"
        + "".join(f"  {job}: {{max_files_per_trigger: 1, trigger_interval: 300ms}}\n" for job in JOBS))
    generate(SMALL, tmp_path / "staging", sources=("payments",))
    files = oracle.files_in_arrival_order(tmp_path / "staging" / "payments")
    landing = home / "landing" / "payments"
    landing.mkdir(parents=True)
    for path in files[:3]:
        shutil.move(path, landing / path.name)
    stop_feeding = threading.Event()

    def feed():
        for path in files[3:]:
            if stop_feeding.wait(1.0):
                return
            shutil.move(path, landing / path.name)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    rng = random.Random(20261126)
    pause_dir = tmp_path / "pauses"
    app = ("run", *JOBS)
    try:
        # 1. a crash loop: killed at random moments, and once inside a batch after purchase_metrics' main commit
        proc = _cli(home, *app, wait=False, log="app.log")
        assert _wait_for(lambda: _commits(home, JOBS[0]) >= 2, 240), excerpt(home / "app.log")
        time.sleep(rng.uniform(0.0, 3.0))  # wherever it is: planning, inside a batch, between batches
        _kill(proc)
        env = {**os.environ, "LAKESTREAM_PAUSE_AT": "committed:lake.payments.purchase_metrics",
               "LAKESTREAM_PAUSE_DIR": str(pause_dir), "LAKESTREAM_PAUSE_SECONDS": "120"}
        proc = _cli(home, *app, env=env, wait=False, log="app.log")
        assert _wait_for(lambda: any(pause_dir.glob("committed:*")), 240), excerpt(home / "app.log")
        _kill(proc)
        # 2. a savepoint of a job whose runner is dead
        code, stderr = _cli(home, "savepoint", "create", JOBS[0])
        assert code == 0, stderr
        savepoint = json.loads(next((home / "savepoints" / JOBS[0]).glob("*/manifest.json")).read_text())["id"]
        # 3. running again: a second runner is refused; a forced backfill of the day runs beside the stream
        proc = _cli(home, *app, wait=False, log="app.log")
        before = _commits(home, JOBS[0])
        assert _wait_for(lambda: _commits(home, JOBS[0]) > before, 240), excerpt(home / "app.log")
        code, stderr = _cli(home, "run", JOBS[0], "--available-now")
        _one_line(code, stderr, f"on {socket.gethostname()}")
        code, stderr = _cli(home, "backfill", JOBS[0], "--start", DAY, "--end", NEXT_DAY, "--force")
        assert code == 0, stderr
        # 4. a file copied in with its old modification time
        copied = landing / "copied-from-an-archive.jsonl"
        copied.write_text("".join(json.dumps(payment(f"old-{i}", int(SMALL.start.timestamp() * 1000) + i * MIN,
                                                      user=f"u{i:05d}")) + "\n" for i in range(8)))
        ten_days_ago = time.time() - 10 * 86400
        os.utime(copied, (ten_days_ago, ten_days_ago))
        feeder.join(timeout=300)
        total = len(list(landing.iterdir()))
        assert _wait_for(lambda: proc.poll() is not None or (_commits(home, JOBS[0]) >= 1 and _inspect_waiting(home) == 0),
                         300), excerpt(home / "app.log")
        assert proc.poll() is None, f"the application ended ({proc.returncode}) with files waiting:\n" + \
            excerpt(home / "app.log")
        os.killpg(proc.pid, signal.SIGINT)  # stopped as Ctrl-C stops it: after the current batch
        assert proc.wait(timeout=120) == 0, excerpt(home / "app.log")
    finally:
        stop_feeding.set()
    # 5. the restore of one job, then both to the end
    code, stderr = _cli(home, "run", JOBS[0], "--from-savepoint", savepoint, "--available-now")
    assert code == 0, stderr
    code, stderr = _cli(home, "run", JOBS[1], "--available-now")
    assert code == 0, stderr

    tables = _read(home, fmt, warehouse, spark)
    # purchase_metrics: the replay of its final checkpoint's batches
    batches = _batches(home, JOBS[0])
    assert sum(len(b) for b in batches) == sum(len(oracle.read_lines(p)) for p in landing.iterdir()), total
    truth = oracle.replay_stream(batches)
    windows = {}
    for r in tables["pm"]:
        key = (r["user_id"], int(r["window_start"].timestamp() * 1000))
        assert key not in windows, f"window {key} written twice"
        windows[key] = (r["event_count"], r["approved_count"], r["declined_count"], Decimal(r["amount_sum"]))
    assert windows == truth.closed
    assert sorted(r["event_id"] for r in tables["pm_late"]) == sorted(truth.late_ids)
    # decline_velocity: the replay of its own batches (10-minute windows sliding by a minute, lateness 2 min)
    dv_batches = [[e for e in map(oj.validate_payment, b) if e is not None] for b in _batches(home, JOBS[1])]
    dv = replay_windows(dv_batches, Win("sliding", size=10 * MIN, every=MIN), delay=5000, lateness=2 * MIN,
                        key=lambda e: e["user_id"], measure=lambda ev: {"declined": len(ev)},
                        having=lambda r: r["declined"] > 5, keep=lambda e: e["status"] == "DECLINED")
    alerts = [(r["user_id"], int(r["window_start"].timestamp() * 1000), r["declined"]) for r in tables["dv"]]
    assert len(alerts) == len({a[:2] for a in alerts}), "an alert written twice"
    assert set(alerts) == {(k[0], k[1], v["declined"]) for k, v in dv.table.items()}
    assert sorted(r["event_id"] for r in tables["dv_late"]) == sorted(i for i, *_ in dv.late)
    # each job's quarantined lines, once, whatever the other job's restore and the backfill did
    for job in JOBS:
        mine = [r for r in tables["q"] if r["detected_by"] == job]
        assert sum(r["occurrences"] for r in mine) == truth.invalid_lines, job
        assert len(mine) == len({(r["source_file"], r["raw_line"]) for r in mine}), f"{job}: a line twice"


def _inspect_waiting(home: Path) -> int:
    from streaming.checkpoint.inspect import inspect_checkpoint

    return inspect_checkpoint(JOBS[0], str(home / "checkpoints" / JOBS[0]), str(home / "landing" / "payments")).files_waiting
