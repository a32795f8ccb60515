"""`lakestream checkpoint inspect` on checkpoints made by real runs: healthy, stalled, mid-batch, damaged.

The expected values come from outside the inspector: the landing folder's files, the stream's own
report (query id, batches), the oracle's watermark over the same files, and the damage we did.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from streaming.checkpoint.health import Thresholds
from streaming.checkpoint.inspect import inspect_checkpoint
from streaming.checkpoint.lease import control_dir
from streaming.project import get_job
from streaming.run.runner import run_stream
from tests import oracle
from tests.conftest import SMALL, settings_for

JOB = "purchase_metrics"
FILES_PER_BATCH = 4
MINUTE_MS = 60_000


class Crash(Exception):
    pass


def _batches_of(files: list[Path], k: int) -> list[list[str]]:
    return [[line for p in files[i : i + k] for line in oracle.read_lines(p)] for i in range(0, len(files), k)]


@pytest.fixture(scope="module")
def healthy(spark, tmp_path_factory):
    """A stream that consumed a landing zone in batches of 4 files; returns (settings, report, files)."""
    from lakestream.generator import generate
    from tests.conftest import drop_job_tables

    drop_job_tables(spark)
    settings = settings_for(tmp_path_factory.mktemp("healthy")).with_job(JOB, max_files_per_trigger=FILES_PER_BATCH)
    generate(SMALL, settings.landing, sources=("payments",))
    report = run_stream(spark, settings, get_job(JOB, settings), available_now=True, progress=None)
    files = oracle.files_in_arrival_order(Path(settings.landing_dir("payments")))
    return settings, report, files


def _inspect(settings, **kw):
    return inspect_checkpoint(JOB, settings.checkpoint_dir(JOB), settings.landing_dir("payments"), **kw)


def test_healthy_checkpoint_reports_batches_files_watermark_and_query_id(healthy):
    settings, stream, files = healthy
    report = _inspect(settings)

    batches = -(-len(files) // FILES_PER_BATCH)
    assert stream.batches == batches
    assert report.query_id == stream.query_id
    assert report.last_planned_batch == report.last_committed_batch == batches - 1
    assert report.in_flight_batch is None
    assert (report.files_consumed, report.files_in_flight, report.files_waiting) == (len(files), 0, 0)
    assert report.watermark_ms == oracle.replay_stream(_batches_of(files, FILES_PER_BATCH)).watermark_ms
    assert report.shuffle_partitions == 2
    assert report.state_bytes > 0 and report.problems == []
    assert report.health.status == "healthy", report.health.messages


def _copy_checkpoint(settings, tmp_path) -> Path:
    copy = tmp_path / "checkpoint"
    shutil.copytree(settings.checkpoint_dir(JOB), copy)
    return copy


def test_new_input_without_commits_is_stalled_and_old_waiting_input_is_a_growing_backlog(healthy, tmp_path):
    settings, _, files = healthy
    landing = tmp_path / "landing"
    shutil.copytree(settings.landing_dir("payments"), landing)
    checkpoint = _copy_checkpoint(settings, tmp_path)
    # The checkpoint's source log names the original landing files: point it at the copy.
    for log in (p for p in (checkpoint / "sources" / "0").iterdir() if not p.name.startswith(".")):
        log.write_text(log.read_text().replace(str(Path(settings.landing_dir("payments")).resolve()), str(landing.resolve())))
    extra = [landing / "payments-late-arrival-1.jsonl", landing / "payments-late-arrival-2.jsonl"]
    last_commit = max(p.stat().st_mtime_ns for p in (checkpoint / "commits").iterdir()) // 1_000_000
    for i, path in enumerate(extra):
        shutil.copy(files[i], path)
        arrived = (last_commit + 1000) / 1000
        os.utime(path, (arrived, arrived))
    limits = Thresholds(trigger_interval_s=10, stall_factor=5)

    # no process runs the stream: waiting input is the normal state of on-demand use, a warning
    idle = inspect_checkpoint(JOB, str(checkpoint), str(landing), limits, now_ms=last_commit + 10 * MINUTE_MS)
    assert idle.health.idle and not idle.health.stalled and idle.health.status == "warning"
    assert any(f"lakestream run {JOB}" in m for m in idle.health.messages)

    # a batch planned when the stream stopped (Spark writes the next offsets before it sees the stop) is replayed
    # when the stream starts: still idle, not a stall; after a crash (a lease never given back) it is a stall
    last = max(int(p.name) for p in (checkpoint / "offsets").iterdir() if p.name.isdigit())
    planned = checkpoint / "offsets" / str(last + 1)
    shutil.copy(checkpoint / "offsets" / str(last), planned)
    stopped = inspect_checkpoint(JOB, str(checkpoint), str(landing), limits, now_ms=last_commit + 10 * MINUTE_MS)
    assert stopped.in_flight_batch == last + 1 and not stopped.died
    assert stopped.health.idle and not stopped.health.stalled and stopped.health.status == "warning", stopped.health
    assert not stopped.health.backlog_growing
    assert any("replayed when the stream starts" in m for m in stopped.health.messages)
    control = Path(control_dir(str(checkpoint)))
    control.mkdir(parents=True, exist_ok=True)
    dead = control / "lease-000000000001.json"
    dead.write_text(json.dumps({"generation": 1, "host": "a-host-that-is-gone", "pid": 4242, "purpose": "stream",
                                "since_ms": last_commit - 20 * MINUTE_MS, "renewed_ms": last_commit - 10 * MINUTE_MS}))
    crashed = inspect_checkpoint(JOB, str(checkpoint), str(landing), limits, now_ms=last_commit + 10 * MINUTE_MS)
    assert crashed.died and crashed.health.stalled and crashed.health.status == "error", crashed.health
    dead.unlink()
    planned.unlink()

    # a process runs it (a live marker) and commits nothing: stalled
    (checkpoint / "lakestream" / "running").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    soon = inspect_checkpoint(JOB, str(checkpoint), str(landing), limits, now_ms=last_commit + 20_000)
    later = inspect_checkpoint(JOB, str(checkpoint), str(landing), limits, now_ms=last_commit + 10 * MINUTE_MS)

    assert soon.files_waiting == later.files_waiting == 2
    assert later.bytes_waiting == sum(p.stat().st_size for p in extra)
    assert not soon.health.stalled and soon.health.status == "healthy"
    assert later.health.stalled and later.health.status == "error"
    assert any("stalled" in m for m in later.health.messages)
    assert not later.health.backlog_growing  # the files came after the last commit

    # the limit follows the job: batches that take 3 minutes each are slow, not stalled, 6 minutes after a commit
    batches = sorted((p for p in (checkpoint / "commits").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    for commit in batches:
        planned = checkpoint / "offsets" / commit.name
        start = (last_commit - 4 * MINUTE_MS) / 1000
        os.utime(planned, (start, start))
        os.utime(commit, (start + 180, start + 180))
    slow_commit = last_commit - MINUTE_MS
    slow = inspect_checkpoint(JOB, str(checkpoint), str(landing), limits, now_ms=slow_commit + 6 * MINUTE_MS)
    assert max(slow.recent_batch_seconds) == pytest.approx(180, abs=1)
    assert not slow.health.stalled, slow.health.messages
    stuck = inspect_checkpoint(JOB, str(checkpoint), str(landing), limits, now_ms=slow_commit + 12 * MINUTE_MS)
    assert stuck.health.stalled and any("longest recent batch" in m for m in stuck.health.messages)

    old = (last_commit - 5 * MINUTE_MS) / 1000
    for path in extra:
        os.utime(path, (old, old))
    behind = inspect_checkpoint(JOB, str(checkpoint), str(landing), limits, now_ms=last_commit + 20_000)
    assert behind.health.backlog_growing and behind.health.status == "warning"


def test_a_landing_file_rewritten_after_the_stream_read_it_is_named_with_the_fix(healthy, tmp_path):
    """Spark never reads a path twice: a file replaced after it was read loses its new lines to the
    stream. The source log recorded its modification time; inspection names the file and the fix."""
    settings, _, files = healthy
    landing = tmp_path / "landing"
    shutil.copytree(settings.landing_dir("payments"), landing)  # (keeps modification times)
    checkpoint = _copy_checkpoint(settings, tmp_path)
    for log in (p for p in (checkpoint / "sources" / "0").iterdir() if not p.name.startswith(".")):
        log.write_text(log.read_text().replace(str(Path(settings.landing_dir("payments")).resolve()), str(landing.resolve())))
    assert _inspect_copy(checkpoint, landing).rewritten_files == []

    victim = landing / files[1].name
    victim.write_text(victim.read_text() + victim.read_text().splitlines()[0] + "\n")  # new content, new mtime
    report = _inspect_copy(checkpoint, landing)

    assert [p.rsplit("/", 1)[-1] for p in report.rewritten_files] == [victim.name]
    assert report.health.rewritten and report.health.status == "error"
    message = next(m for m in report.health.messages if m.startswith("rewritten input"))
    assert victim.name in message and "new file names" in message and "backfill" in message


def _inspect_copy(checkpoint: Path, landing: Path):
    return inspect_checkpoint(JOB, str(checkpoint), str(landing), Thresholds(trigger_interval_s=3600))


def test_a_run_that_died_inside_a_batch_leaves_that_batch_in_flight(spark, lake):
    from lakestream.generator import generate

    settings = lake.with_job(JOB, max_files_per_trigger=FILES_PER_BATCH)
    generate(SMALL, settings.landing, sources=("payments",))

    def crash(point: str, batch_id: int) -> None:
        if point == "before-state" and batch_id == 2:
            raise Crash("killed inside batch 2")

    with pytest.raises(Exception, match="killed inside batch 2"):
        run_stream(spark, settings, get_job(JOB, settings), available_now=True, progress=None, fault=crash)
    files = oracle.files_in_arrival_order(Path(settings.landing_dir("payments")))

    report = _inspect(settings)

    assert (report.last_planned_batch, report.last_committed_batch, report.in_flight_batch) == (2, 1, 2)
    assert report.files_consumed == 2 * FILES_PER_BATCH
    assert report.files_in_flight == FILES_PER_BATCH
    assert report.files_waiting == len(files) - 3 * FILES_PER_BATCH
    assert report.health.in_flight and not report.health.corrupt


DAMAGE = {
    "truncated offset log": ("offsets/{last}", "v1\n{\"batchWaterm"),
    "commit without version line": ("commits/{last}", "garbage"),
    "empty commit": ("commits/{last}", ""),
    "metadata without id": ("metadata", "{}"),
    "engine record": ("lakestream/batches/{last}.json", "{not json"),
    "source log line": ("sources/0/{last}", "v1\n{\"path\": \"file:///x\", \"time"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_files_are_reported_as_corrupt_not_raised(healthy, tmp_path, damage):
    settings, stream, _ = healthy
    checkpoint = _copy_checkpoint(settings, tmp_path)
    name, text = DAMAGE[damage]
    target = checkpoint / name.format(last=stream.batches - 1)
    assert target.exists()
    target.write_text(text)

    report = inspect_checkpoint(JOB, str(checkpoint), settings.landing_dir("payments"))

    assert report.health.corrupt and report.health.status == "error"
    assert any(name.split("/")[0] in p for p in report.problems), report.problems


def test_missing_checkpoint_and_deleted_metadata(tmp_path, healthy):
    report = inspect_checkpoint(JOB, str(tmp_path / "nowhere"), str(tmp_path / "no-landing"))
    assert not report.exists and report.health.status == "healthy"
    assert "never run" in " ".join(report.health.messages)

    settings, _, _ = healthy
    checkpoint = _copy_checkpoint(settings, tmp_path)
    (checkpoint / "metadata").unlink()
    assert any("metadata is missing" in p for p in inspect_checkpoint(JOB, str(checkpoint)).problems)


def _cli(settings, *argv):
    return subprocess.run(
        [sys.executable, "-m", "lakestream.cli", "--home", str(Path(settings.landing).parent), *argv],
        capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if k != "LAKESTREAM_CONFIG"},
    )


def test_cli_prints_json_without_starting_spark(healthy):
    settings, stream, files = healthy
    result = _cli(settings, "checkpoint", "inspect", JOB, "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["query_id"] == stream.query_id and data["files_consumed"] == len(files)
    assert "SparkContext" not in result.stderr and "Setting default log level" not in result.stderr


def test_a_checkpoint_and_landing_zone_on_an_object_store_are_read_alike_without_a_jvm(healthy):
    """fsspec's memory:// file system stands in for s3a:// or abfss://: the checkpoint and the landing
    zone are uploaded as a cluster job would have written them, and read through the object-store path."""
    import fsspec

    from tests.objectstore import upload

    settings, stream, files = healthy
    local = _inspect(settings)
    fs = fsspec.filesystem("memory")
    checkpoints, landing_root = upload(settings, JOB)
    remote_landing = f"{landing_root}/payments"
    bucket = checkpoints.split("://", 1)[1].rsplit("/checkpoints", 1)[0]
    for i in range(2):  # two files arrive after the stream stopped
        fs.pipe(f"{remote_landing}/zz-late-{i}.jsonl", files[i].read_bytes())

    remote = inspect_checkpoint(JOB, f"memory://{bucket}/checkpoints/{JOB}", remote_landing)

    assert remote.exists and remote.problems == []
    assert remote.query_id == stream.query_id
    assert (remote.last_planned_batch, remote.last_committed_batch) == (stream.batches - 1, stream.batches - 1)
    assert (remote.files_consumed, remote.files_in_flight, remote.files_waiting) == (len(files), 0, 2)
    assert remote.bytes_waiting == files[0].stat().st_size + files[1].stat().st_size
    assert remote.watermark_ms == oracle.replay_stream(_batches_of(files, FILES_PER_BATCH)).watermark_ms
    assert remote.state_bytes == local.state_bytes > 0
    assert [(o.operator, o.partitions, o.latest_version) for o in remote.state_operators] == \
        [(o.operator, o.partitions, o.latest_version) for o in local.state_operators]
    assert remote.last_commit_ms is not None and remote.shuffle_partitions == 2

    fs.pipe(f"{bucket}/checkpoints/{JOB}/commits/{stream.batches - 1}", b"garbage")
    damaged = inspect_checkpoint(JOB, f"memory://{bucket}/checkpoints/{JOB}", remote_landing)
    assert damaged.health.corrupt and any("commits/" in p for p in damaged.problems)
    fs.rm(bucket, recursive=True)


def test_an_object_store_without_its_python_file_system_is_one_clear_problem():
    report = inspect_checkpoint(JOB, "nosuchfs://bucket/checkpoints/purchase_metrics", "nosuchfs://bucket/landing")
    assert report.health.status == "error" and len(report.problems) == 1
    assert "install fsspec's implementation of nosuchfs" in report.problems[0]
    if importlib.util.find_spec("s3fs") is None:  # the usual case here: the hint names the package to install
        s3 = inspect_checkpoint(JOB, "s3a://bucket/checkpoints/purchase_metrics")
        assert "s3fs" in s3.problems[0] and s3.health.status == "error"


def test_status_shows_every_job_and_whether_a_process_runs_it(healthy, tmp_path):
    settings, stream, files = healthy
    marker = Path(settings.checkpoint_dir(JOB)) / "lakestream" / "running"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        marker.write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname(), "query_id": stream.query_id,
                                      "started_ms": 0}))
        alive = _cli(settings, "status", "--json")
        table = _cli(settings, "status")
    finally:
        sleeper.kill()
        sleeper.wait()
    gone = _cli(settings, "status", "--json")  # the marker stays, its process is gone: not running
    marker.unlink()

    assert alive.returncode == 0, alive.stderr
    jobs = {r["job"]: r for r in json.loads(alive.stdout)}
    assert set(jobs) == {"purchase_metrics", "decline_velocity", "user_sessions", "large_amount_alerts",
                         "rolling_spend", "suspicious_logins"}
    assert jobs[JOB]["running"]["pid"] == sleeper.pid
    assert jobs[JOB]["last_committed_batch"] == stream.batches - 1 and jobs[JOB]["files_waiting"] == 0
    assert jobs["decline_velocity"]["exists"] is False and jobs["decline_velocity"]["files_waiting"] == len(files)
    assert {r["job"]: r["running"] for r in json.loads(gone.stdout)}[JOB] is None
    line = next(row for row in table.stdout.splitlines() if row.startswith(JOB))
    assert f"running (pid {sleeper.pid})" in line and f" {stream.batches - 1} " in line
    assert "never run" in next(row for row in table.stdout.splitlines() if row.startswith("rolling_spend"))
    assert "SparkContext" not in table.stderr
