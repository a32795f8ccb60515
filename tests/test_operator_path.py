"""Exactly-once on the operator's path: what an on-call engineer does to streams that are running, crashed or
stopped — savepoints of a crashed stream, restores beside other jobs, a second runner, restores that are
interrupted, retention under a clock that steps back, the compiled file system's cache, the dbt profile.
Every table is compared with its plain-Python oracle; every refusal is one line."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from lakestream.generator import generate
from streaming.checkpoint.lease import Holder, Lease, control_dir
from streaming.checkpoint.savepoints import Savepoints
from streaming.errors import LeaseHeldError, LeaseLostError
from streaming.io.sinks import sink_for
from streaming.project import get_job
from streaming.run.runner import run_stream
from tests import oracle
from tests.conftest import SMALL
from tests.test_purchase_metrics import table_windows

JOB = "purchase_metrics"
K = 4  # files per micro-batch


class Crash(Exception):
    pass


def _staged(settings, tmp_path) -> tuple[Path, list[Path]]:
    generate(SMALL, tmp_path / "staging", sources=("payments",))
    landing = Path(settings.landing_dir("payments"))
    landing.mkdir(parents=True, exist_ok=True)
    return landing, oracle.files_in_arrival_order(tmp_path / "staging" / "payments")


def _arrive(files, landing) -> None:
    for p in files:
        shutil.move(p, landing / p.name)


def _run(spark, settings, name=JOB, **kw):
    return run_stream(spark, settings, get_job(name, settings), available_now=True, progress=None,
                      install_signal_handlers=False, **kw)


def _truth(landing: Path) -> oracle.StreamTruth:
    files = oracle.files_in_arrival_order(landing)
    return oracle.replay_stream([[line for p in files[i:i + K] for line in oracle.read_lines(p)]
                                 for i in range(0, len(files), K)])


def _quarantined(spark, settings, job: str) -> int:
    table = sink_for(spark, settings, get_job(job).source.quarantine, job).read()
    return table.where(table.detected_by == job).agg({"occurrences": "sum"}).first()[0] or 0


def _assert_tables_match_the_oracle(spark, settings, landing: Path) -> None:
    """The job's windows, late rows and quarantined lines, as the plain-Python replay of ``landing`` has them."""
    truth = _truth(landing)
    table = sink_for(spark, settings, get_job(JOB).sink, JOB).read()
    table.createOrReplaceTempView("checked_windows")
    assert table_windows(spark, "checked_windows") == truth.closed  # fails on a window written twice
    late = sink_for(spark, settings, get_job(JOB).late_sink, JOB).read().collect()
    assert sorted(r.event_id for r in late) == sorted(truth.late_ids)
    assert _quarantined(spark, settings, JOB) == truth.invalid_lines


def _crash_at(point: str, batch: int):
    def fault(at: str, batch_id: int) -> None:
        if at == point and batch_id == batch:
            raise Crash(f"injected crash at {at} in batch {batch_id}")
    return fault


@pytest.mark.parametrize("fmt", ["iceberg", "delta"])
def test_a_savepoint_of_a_stream_that_died_inside_a_batch_restores_without_doubling_that_batch(spark, lake, tmp_path,
                                                                                              fmt):
    """The stream dies after batch 2 committed its main table and its quarantine, before Spark recorded the batch:
    the savepoint is the state as of batch 1 (the versions before batch 2's commits), so a restore replays batch 2
    once."""
    settings = replace(lake, format=fmt).with_job(JOB, max_files_per_trigger=K)
    landing, files = _staged(settings, tmp_path)
    _arrive(files[: 4 * K], landing)
    with pytest.raises(Exception, match="injected crash"):
        _run(spark, settings, fault=_crash_at("before-state", 2))
    savepoints = Savepoints(spark, settings, progress=None)
    sp = savepoints.create(get_job(JOB, settings))  # the process is dead: nothing to stop
    assert sp.manifest["batch_id"] == 1

    _run(spark, settings)  # the job runs on past the savepoint (it replays batch 2 exactly once, then more)
    _arrive(files[4 * K:], landing)
    _run(spark, settings)
    savepoints.restore(get_job(JOB, settings), sp.id)
    _run(spark, settings)

    _assert_tables_match_the_oracle(spark, settings, landing)


@pytest.mark.parametrize("fmt", ["iceberg", "delta"])
def test_a_first_large_batch_that_wrote_its_ids_in_its_statistics_and_died_is_replayed_once(spark, lake, tmp_path,
                                                                                           monkeypatch, fmt):
    """A stream's first batch, large and with its ids kept off the driver, writes its ids file in its statistics job,
    before its other outputs. It dies after committing its tables, before its record: the next run replays it (the
    ids written again, in place of the first attempt's), and later batches drop the ids it remembers. Every table
    matches the plain-Python oracle, and the store holds each id of the batch once."""
    import pyarrow.parquet as pq

    import streaming.windowed.batch as windowed_batch
    from streaming.checkpoint.layout import Layout

    monkeypatch.setattr(windowed_batch, "LARGE_BATCH_BYTES", 0)  # (every batch counts as large ...)
    monkeypatch.setattr(windowed_batch, "DRIVER_LOOKUP_BYTES", 0)  # (... and brings no ids to the driver)
    wrote = []
    written = windowed_batch.WindowedBatch._repeats_and_ids
    monkeypatch.setattr(windowed_batch.WindowedBatch, "_repeats_and_ids",
                        lambda self, lines: wrote.append(self.batch_id) or written(self, lines))
    settings = replace(lake, format=fmt).with_job(JOB, max_files_per_trigger=K)
    landing, files = _staged(settings, tmp_path)
    _arrive(files[:K], landing)
    with pytest.raises(Exception, match="injected crash"):
        _run(spark, settings, fault=_crash_at("before-state", 0))
    _run(spark, settings)  # replays batch 0
    _arrive(files[K:], landing)
    _run(spark, settings)

    assert wrote == [0, 0], "the first attempt and the replay wrote the ids in their statistics job; no later batch"
    _assert_tables_match_the_oracle(spark, settings, landing)
    first = [line for p in oracle.files_in_arrival_order(landing)[:K] for line in oracle.read_lines(p)]
    distinct = {str(e["event_id"]) for e in map(oracle.validate, first) if e is not None}
    store = Path(Layout(settings.checkpoint_dir(JOB)).store.removeprefix("file:"))
    ids = pq.read_table(store / "0" / "ids", columns=["_h1", "_h2"]).to_pandas()
    assert len(ids) == len(distinct) and not ids.duplicated().any()


def test_a_restore_of_one_job_keeps_the_quarantine_rows_another_job_wrote_to_the_shared_table(spark, lake, tmp_path):
    """purchase_metrics and decline_velocity both quarantine into lake.quarantine.payments: restoring the first
    deletes only its own rows written after the savepoint."""
    settings = lake.with_job(JOB, max_files_per_trigger=K).with_job("decline_velocity", max_files_per_trigger=K)
    landing, files = _staged(settings, tmp_path)
    _arrive(files[: 2 * K], landing)
    _run(spark, settings)
    _run(spark, settings, "decline_velocity")
    savepoints = Savepoints(spark, settings, progress=None)
    sp = savepoints.create(get_job(JOB, settings))
    _arrive(files[2 * K:], landing)
    _run(spark, settings)
    _run(spark, settings, "decline_velocity")

    savepoints.restore(get_job(JOB, settings), sp.id)
    truth = _truth(landing)
    assert _quarantined(spark, settings, "decline_velocity") == truth.invalid_lines  # untouched by the restore
    _run(spark, settings)
    assert _quarantined(spark, settings, JOB) == truth.invalid_lines  # its own: once, not twice
    assert _quarantined(spark, settings, "decline_velocity") == truth.invalid_lines


def test_an_interrupted_restore_is_finished_by_the_next_start_of_the_stream(spark, lake, tmp_path):
    """The restore dies after rolling the tables back, before the checkpoint is replaced: the next start of the
    stream (without --from-savepoint, as the supervisor restarts it) finishes the restore first."""
    settings = lake.with_job(JOB, max_files_per_trigger=K)
    landing, files = _staged(settings, tmp_path)
    _arrive(files[: 2 * K], landing)
    _run(spark, settings)
    sp = Savepoints(spark, settings, progress=None).create(get_job(JOB, settings))
    _arrive(files[2 * K:], landing)
    _run(spark, settings)
    dying = Savepoints(spark, settings, progress=None, fault=_crash_at("restore:tables", sp.manifest["batch_id"]))
    with pytest.raises(Crash):
        dying.restore(get_job(JOB, settings), sp.id)
    assert Lease(settings.checkpoint_dir(JOB)).pending_restore() == sp.id
    _run(spark, settings)

    assert Lease(settings.checkpoint_dir(JOB)).pending_restore() is None
    truth = _truth(landing)
    assert table_windows(spark) == truth.closed  # rows after the savepoint are neither lost nor doubled
    assert _quarantined(spark, settings, JOB) == truth.invalid_lines


def test_retention_keeps_the_newest_savepoint_when_the_clock_steps_back(spark, small_landing, monkeypatch):
    import streaming.checkpoint.savepoints as module

    settings = small_landing.with_job(JOB, max_files_per_trigger=8)
    _run(spark, settings)
    savepoints = Savepoints(spark, settings, progress=None)
    first = savepoints.create(get_job(JOB, settings))

    class Earlier(datetime):  # the host's clock stepped back an hour
        @classmethod
        def now(cls, tz=None):
            return datetime.now(tz) - timedelta(hours=1)

    monkeypatch.setattr(module, "datetime", Earlier)
    second = savepoints.create(get_job(JOB, settings), keep=1)
    assert [s.id for s in savepoints.list(JOB)] == [second.id]
    assert second.manifest["sequence"] == first.manifest["sequence"] + 1


# -- one writer per checkpoint ---------------------------------------------------------------------------------


def _holder(generation: int, **changes) -> dict:
    now = int(time.time() * 1000)
    base = Holder(generation=generation, host=socket.gethostname(), pid=os.getpid(), purpose="stream", since_ms=now,
                  renewed_ms=now)
    return asdict(replace(base, **changes))


def _plant(checkpoint: Path, holder: dict) -> None:
    folder = Path(control_dir(str(checkpoint)))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"lease-{holder['generation']:012d}.json").write_text(json.dumps(holder))


def test_a_dead_holders_lease_is_taken_over_and_a_live_ones_is_refused_naming_it(tmp_path):
    checkpoint = tmp_path / "checkpoints" / "job"
    long_ago = int(time.time() * 1000) - 10 * 60_000
    # a crashed pod: another host, not renewed for ten minutes
    _plant(checkpoint, _holder(7, host="pod-4711", pid=1, renewed_ms=long_ago, since_ms=long_ago))
    taken = Lease(str(checkpoint), job="job").acquire("stream")
    assert taken.mine.generation == 8 and [p.name for p in Path(control_dir(str(checkpoint))).iterdir()] == [
        "lease-000000000008.json"]
    # a live holder on another host is refused in one line that names it
    with pytest.raises(LeaseHeldError) as refused:
        Lease(str(checkpoint), job="job").acquire("savepoint")
    assert str(refused.value).count("\n") == 0 and f"pid {os.getpid()} on {socket.gethostname()}" in str(refused.value)
    taken.release()

    # a reused pid: this process's pid, but the process that wrote the lease started at another time
    _plant(checkpoint, _holder(3, pid_start="1"))
    assert Lease(str(checkpoint), job="job").acquire("stream").mine.generation == 4
    # a dead pid on this host
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    other = tmp_path / "checkpoints" / "other"
    _plant(other, _holder(1, pid=dead.pid, pid_start=None))
    assert Lease(str(other), job="other").acquire("stream").mine.generation == 2


def test_a_holder_that_lost_its_lease_stops_committing_and_leaves_the_new_holder_alone(tmp_path):
    checkpoint = str(tmp_path / "ck")
    first = Lease(checkpoint, job="job", ttl_ms=600).acquire("stream")
    time.sleep(0.7)  # it did not renew for its ttl; a holder on another host would now be dead
    Path(control_dir(checkpoint), "lease-000000000001.json").write_text(json.dumps(
        {**json.loads(Path(control_dir(checkpoint), "lease-000000000001.json").read_text()), "host": "pod-1"}))
    second = Lease(checkpoint, job="job").acquire("stream")
    with pytest.raises(LeaseLostError, match="taken over"):
        first.check()
    first.release()  # the loser's clean-up leaves the winner's lease
    assert Lease(checkpoint).holder().generation == second.mine.generation == 2


def test_of_many_processes_taking_one_lease_at_once_exactly_one_wins(tmp_path):
    code = ("import sys; from streaming.checkpoint.lease import Lease; from streaming.errors import LeaseHeldError\n"
            "try:\n  Lease(sys.argv[1]).acquire('stream'); print('won'); import time; time.sleep(3)\n"
            "except LeaseHeldError:\n  print('refused')")
    racers = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "ck")], stdout=subprocess.PIPE, text=True)
              for _ in range(8)]
    said = sorted(r.communicate(timeout=120)[0].strip() for r in racers)
    assert said == ["refused"] * 7 + ["won"]


def test_of_many_processes_taking_one_lease_on_an_object_store_exactly_one_wins(tmp_path):
    """The same race on an S3 API (moto on loopback, which answers a conditional put as S3 does: 412)."""
    moto = pytest.importorskip("moto.server", reason="the test extra installs moto")
    boto3 = pytest.importorskip("boto3")
    server = moto.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}
        boto3.client("s3", endpoint_url=f"http://{host}:{port}", aws_access_key_id="k", aws_secret_access_key="s",
                     region_name="us-east-1").create_bucket(Bucket="lake")
        options = json.dumps({"client_kwargs": {"endpoint_url": f"http://{host}:{port}"}})
        code = ("import json, sys, time; from streaming.checkpoint.lease import Lease\n"
                "from streaming.errors import LeaseHeldError\n"
                "try:\n  Lease(sys.argv[1], json.loads(sys.argv[2])).acquire('stream'); print('won'); time.sleep(3)\n"
                "except LeaseHeldError:\n  print('refused')")
        racers = [subprocess.Popen([sys.executable, "-c", code, "s3a://lake/checkpoints/job", options], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(6)]
        said = sorted(r.communicate(timeout=120)[0].strip() for r in racers)
        assert said == ["refused"] * 5 + ["won"]
    finally:
        server.stop()


def test_a_second_runner_of_a_running_job_is_refused_in_one_line_and_the_first_goes_on(spark, small_landing):
    from tests.conftest import write_config
    from tests.test_cli import assert_one_line_error, lakestream

    settings = write_config(small_landing, {JOB: {"max_files_per_trigger": 2, "trigger_interval": "1s"}})
    job = get_job(JOB, settings)
    stop, reports, errors = threading.Event(), [], []

    def stream():
        try:
            reports.append(run_stream(spark, settings, job, available_now=False, progress=None,
                                      install_signal_handlers=False, stop_event=stop))
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    runner = threading.Thread(target=stream, daemon=True)
    runner.start()
    commits = Path(settings.checkpoint_dir(JOB)) / "commits"
    deadline = time.monotonic() + 180
    while not (commits.is_dir() and any(p.name.isdigit() for p in commits.iterdir())):
        assert time.monotonic() < deadline and runner.is_alive(), errors
        time.sleep(0.5)
    with pytest.raises(LeaseHeldError, match=f"already held by a stream .*pid {os.getpid()} on {socket.gethostname()}"):
        run_stream(spark, settings, job, available_now=True, progress=None, install_signal_handlers=False)
    cli = lakestream("run", JOB, "--available-now", home=str(settings.home))
    assert_one_line_error(cli, f"pid {os.getpid()} on {socket.gethostname()}")
    stop.set()
    runner.join(timeout=120)
    assert not errors, errors
    _run(spark, settings)  # the lease was given back: the job runs again, and ends as the oracle says
    assert table_windows(spark) == oracle.replay_stream(
        [[line for p in oracle.files_in_arrival_order(Path(settings.landing_dir("payments")))[i:i + 2]
          for line in oracle.read_lines(p)] for i in range(0, 100, 2)]).closed


# -- the compiled file system's cache ------------------------------------------------------------------------


def _settings(tmp_path, cache):
    from streaming.settings import Settings

    return Settings.load({"LAKESTREAM_HOME": str(tmp_path / "home"), "LAKESTREAM_CACHE": str(cache)})


def test_a_cache_folder_that_cannot_be_read_keeps_hadoops_file_system_without_an_error(tmp_path):
    from streaming.spark import localfs

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "hadoop-fs-x").mkdir()
    os.chmod(cache, 0)
    try:
        if os.access(cache, os.R_OK | os.X_OK):  # (root reads it anyway: a cache of another user, then)
            os.chmod(cache, 0o755)
            os.chown(cache, 54321, 54321)
        assert localfs.class_jar(_settings(tmp_path, cache)) is None
    finally:
        os.chmod(cache, 0o755)


@pytest.mark.skipif(shutil.which("javac") is None and not os.environ.get("JAVA_HOME"), reason="no javac here")
def test_a_class_in_a_cache_others_can_write_is_not_loaded(tmp_path):
    from streaming.spark import localfs

    cache = tmp_path / "cache"
    built = localfs.class_jar(_settings(tmp_path, cache))
    assert built is not None
    os.chmod(built, 0o777)  # anyone could have replaced the class the driver's JVM would load
    assert localfs.class_jar(_settings(tmp_path, cache)) is None
    os.chmod(built, 0o700)
    assert localfs.class_jar(_settings(tmp_path, cache)) == built


def test_a_compiler_that_failed_is_not_tried_again_on_every_session(tmp_path, monkeypatch):
    from streaming.spark import localfs

    javac = tmp_path / "javac"
    calls = tmp_path / "calls"
    javac.write_text(f"#!/bin/sh\necho run >> {calls}\necho 'error: cannot compile' >&2\nexit 1\n")
    javac.chmod(0o755)
    monkeypatch.setattr(localfs, "_javac", lambda: str(javac))
    settings = _settings(tmp_path, tmp_path / "cache")
    assert localfs.class_jar(settings) is None
    assert localfs.class_jar(settings) is None
    assert calls.read_text().count("run") == 1
    os.utime(javac, (time.time() + 5, time.time() + 5))  # another compiler (or a new version of it): tried again
    assert localfs.class_jar(settings) is None and calls.read_text().count("run") == 2


def test_the_dbt_profile_is_readable_by_its_owner_only(tmp_path):
    from orchestration.dbt import write_profiles
    from streaming.settings import Settings

    folder = write_profiles(Settings.load({"LAKESTREAM_HOME": str(tmp_path)}))
    assert stat.S_IMODE(os.stat(folder / "profiles.yml").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    os.chmod(folder / "profiles.yml", 0o644)  # written by an earlier lakestream: tightened
    write_profiles(Settings.load({"LAKESTREAM_HOME": str(tmp_path)}))
    assert stat.S_IMODE(os.stat(folder / "profiles.yml").st_mode) == 0o600
