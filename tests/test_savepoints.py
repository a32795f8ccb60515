"""Savepoints and the compatibility guard, with real streams and real Iceberg tables."""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from streaming.checkpoint.compat import differences
from streaming.declaration import Table
from streaming.windows import Tumbling
from streaming.errors import IncompatibleStateError, SavepointError
from lakestream.generator import generate
from streaming.project import get_job
from streaming.run.runner import run_stream
from streaming.checkpoint.savepoints import Savepoints
from streaming.io.sinks import IcebergSink, sink_for
from streaming.io.tables import all_tables
from tests import oracle
from tests.conftest import SMALL
from tests.test_purchase_metrics import table_windows

JOB = "purchase_metrics"
K = 4  # files per micro-batch


def _staged(settings, tmp_path) -> tuple[Path, list[Path]]:
    generate(SMALL, tmp_path / "staging", sources=("payments",))
    landing = Path(settings.landing_dir("payments"))
    landing.mkdir(parents=True)
    return landing, oracle.files_in_arrival_order(tmp_path / "staging" / "payments")


def _run(spark, settings):
    return run_stream(spark, settings, get_job(JOB, settings), available_now=True, progress=None,
                      install_signal_handlers=False)


def _arrive(files, landing) -> None:
    for p in files:
        shutil.move(p, landing / p.name)


@pytest.mark.parametrize("fmt", ["iceberg", "delta"])
def test_savepoint_then_more_input_then_restore_equals_an_uninterrupted_run(spark, lake, tmp_path, fmt):
    settings = replace(lake, format=fmt).with_job(JOB, max_files_per_trigger=K)
    landing, files = _staged(settings, tmp_path)
    _arrive(files[: 2 * K], landing)
    _run(spark, settings)
    savepoints = Savepoints(spark, settings, progress=None)
    sp = savepoints.create(get_job(JOB, settings))
    assert sp.manifest["batch_id"] == 1 and sp.manifest["keys"] == ["user_id"] and sp.manifest["format"] == fmt
    main = sink_for(spark, settings, get_job(JOB).sink, JOB)
    assert sp.manifest["tables"]["lake.payments.purchase_metrics"] == main.version() is not None

    _arrive(files[2 * K :], landing)  # the landing zone keeps filling; the job runs on past the savepoint
    _run(spark, settings)
    assert main.version() != sp.manifest["tables"]["lake.payments.purchase_metrics"]

    savepoints.restore(get_job(JOB, settings), sp.id)
    for name, version in sp.manifest["tables"].items():
        sink = sink_for(spark, settings, Table(name), JOB)
        if name.startswith("lake.quarantine."):  # shared with other jobs: only this job's later rows go (below)
            continue
        if version is None:  # empty at the savepoint: emptied
            assert sink.read().count() == 0
        elif fmt == "iceberg":
            assert sink.version() == version
        else:  # Delta restores by writing a new version with the old content
            from deltalake import DeltaTable

            assert sink.read().count() == DeltaTable(sink.location(), version=version).to_pyarrow_table().num_rows
    resumed = _run(spark, settings)

    all_files = oracle.files_in_arrival_order(landing)
    assert resumed.batches == -(-(len(all_files) - 2 * K) // K)
    batches = [[line for p in all_files[i : i + K] for line in oracle.read_lines(p)] for i in range(0, len(all_files), K)]
    truth = oracle.replay_stream(batches)
    read = {t.name: sink_for(spark, settings, t, JOB).read() for t in all_tables(get_job(JOB))}
    read["lake.payments.purchase_metrics"].createOrReplaceTempView("restored_windows")
    assert table_windows(spark, "restored_windows") == truth.closed  # also fails on a duplicate window
    late = read["lake.payments.purchase_metrics_late"].collect()
    assert sorted(r.event_id for r in late) == sorted(truth.late_ids)
    quarantined = read["lake.quarantine.payments"].agg({"occurrences": "sum"}).first()[0]
    assert quarantined == truth.invalid_lines


def test_stop_with_savepoint_stops_a_running_stream_after_its_batch(spark, lake, tmp_path):
    settings = lake.with_job(JOB, max_files_per_trigger=1, trigger_interval=timedelta(seconds=1))
    generate(SMALL, settings.landing, sources=("payments",))
    job = get_job(JOB, settings)
    reports, errors = [], []

    def stream():
        try:
            reports.append(run_stream(spark, settings, job, available_now=False, progress=None,
                                      install_signal_handlers=False))
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(exc)

    runner = threading.Thread(target=stream, daemon=True)
    runner.start()
    commits = Path(settings.checkpoint_dir(JOB)) / "commits"
    deadline = time.monotonic() + 180
    while not (commits.is_dir() and any(p.name.isdigit() for p in commits.iterdir())):
        assert time.monotonic() < deadline and runner.is_alive(), errors
        time.sleep(0.5)

    sp = Savepoints(spark, settings, progress=None).create(job, timeout_s=120)

    runner.join(timeout=60)
    assert not runner.is_alive() and not errors, errors
    last_commit = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    assert sp.manifest["batch_id"] == last_commit
    assert not (Path(settings.checkpoint_dir(JOB)) / "lakestream" / "running").exists()
    for name, snapshot in sp.manifest["tables"].items():  # nothing was written after the copy
        assert IcebergSink(spark, Table(name)).version() == snapshot


def test_changed_keys_or_window_are_refused_before_anything_runs(spark, small_landing):
    settings = small_landing.with_job(JOB, max_files_per_trigger=8)
    _run(spark, settings)
    job = get_job(JOB, settings)
    sp = Savepoints(spark, settings, progress=None).create(job)
    commits = sorted((Path(settings.checkpoint_dir(JOB)) / "commits").iterdir())

    rekeyed = replace(job, keys=("card_id",))
    with pytest.raises(IncompatibleStateError, match=r"key columns changed from \['user_id'\] to \['card_id'\]"):
        run_stream(spark, settings, rekeyed, available_now=True, progress=None, install_signal_handlers=False)
    wider = replace(job, window=Tumbling(timedelta(minutes=10)))
    with pytest.raises(IncompatibleStateError, match=r"window changed from Tumbling\(size=5m\) to Tumbling\(size=10m\)"):
        Savepoints(spark, settings, progress=None).restore(wider, sp.id)
    assert sorted((Path(settings.checkpoint_dir(JOB)) / "commits").iterdir()) == commits  # untouched


def test_shuffle_partitions_change_is_named():
    job = get_job(JOB)
    assert differences(job.shape(), 2, job, 2) == []
    assert differences(job.shape(), 2, job, 8) == ["shuffle partitions changed from 2 to 8"]


def test_list_show_delete_and_retention(spark, small_landing):
    settings = small_landing.with_job(JOB, max_files_per_trigger=8)
    _run(spark, settings)
    job = get_job(JOB, settings)
    savepoints = Savepoints(spark, settings, progress=None)
    made = [savepoints.create(job, keep=2).id for _ in range(3)]

    listed = [s.id for s in savepoints.list(JOB)]
    assert listed == made[1:]  # the oldest fell to retention
    manifest = savepoints.get(made[2]).manifest
    assert {"job", "code_version", "batch_id", "source", "tables", "state", "keys", "shuffle_partitions",
            "spark_version", "created"} <= set(manifest)
    savepoints.delete(made[1])
    assert [s.id for s in savepoints.list(JOB)] == [made[2]]
    with pytest.raises(SavepointError, match="no savepoint"):
        savepoints.get(made[1])


def _fingerprint(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> content hash)."""
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _ran_past_a_savepoint(spark, settings, tmp_path):
    landing, files = _staged(settings, tmp_path)
    _arrive(files[: 2 * K], landing)
    _run(spark, settings)
    sp = Savepoints(spark, settings, progress=None).create(get_job(JOB, settings))
    _arrive(files[2 * K :], landing)
    _run(spark, settings)  # the job runs on past the savepoint
    versions = {t.name: sink_for(spark, settings, t, JOB).version() for t in all_tables(get_job(JOB))}
    return landing, sp, versions


def _assert_untouched(spark, settings, landing, before: dict, versions: dict) -> None:
    assert _fingerprint(Path(settings.checkpoint_dir(JOB))) == before, "the checkpoint changed"
    assert {t.name: sink_for(spark, settings, t, JOB).version() for t in all_tables(get_job(JOB))} == versions
    again = _run(spark, settings)  # a plain run afterwards re-appends nothing
    assert again.batches == 0
    all_files = oracle.files_in_arrival_order(landing)
    truth = oracle.replay_stream([[line for p in all_files[i:i + K] for line in oracle.read_lines(p)]
                                  for i in range(0, len(all_files), K)])
    assert table_windows(spark) == truth.closed


def test_a_restore_refused_for_a_mismatched_format_changes_neither_checkpoint_nor_tables(spark, lake, tmp_path):
    settings = lake.with_job(JOB, max_files_per_trigger=K)
    landing, sp, versions = _ran_past_a_savepoint(spark, settings, tmp_path)
    before = _fingerprint(Path(settings.checkpoint_dir(JOB)))

    mismatched = replace(settings, format="delta")
    with pytest.raises(SavepointError, match="recorded iceberg tables but purchase_metrics is configured for delta"):
        Savepoints(spark, mismatched, progress=None).restore(get_job(JOB, mismatched), sp.id)

    _assert_untouched(spark, settings, landing, before, versions)


def test_a_restore_refused_for_an_expired_snapshot_changes_neither_checkpoint_nor_tables(spark, lake, tmp_path):
    settings = lake.with_job(JOB, max_files_per_trigger=K)
    landing, sp, versions = _ran_past_a_savepoint(spark, settings, tmp_path)
    # (a savepoint tags its snapshots so that expiry keeps them: an operator drops the tag, then expires)
    spark.sql(f"ALTER TABLE lake.payments.purchase_metrics DROP TAG `{sp.manifest['tags']['lake.payments.purchase_metrics']}`")
    spark.sql("CALL lake.system.expire_snapshots(table => 'payments.purchase_metrics', "
              "older_than => TIMESTAMP '2999-01-01 00:00:00', retain_last => 1)")
    before = _fingerprint(Path(settings.checkpoint_dir(JOB)))

    with pytest.raises(SavepointError, match="no longer has version"):
        Savepoints(spark, settings, progress=None).restore(get_job(JOB, settings), sp.id)

    _assert_untouched(spark, settings, landing, before, versions)


def test_a_keyed_stream_restored_from_a_savepoint_resumes_its_keys_as_they_were(spark, lake, tmp_path, monkeypatch):
    """rolling_spend keeps each card's state in key files named by Spark's group state: a savepoint copies both,
    and after more batches (whose files replace and drop the older ones) a restore resumes the cards' state as
    the savepoint had it, as an uninterrupted run (one row per change, none twice)."""
    from streaming.keyed import files as key_files
    from tests import oracle_jobs as oj

    monkeypatch.setattr(key_files, "COMPACT_AFTER", 2)  # a bucket's files are merged (and dropped) every batch or two
    job_name = "rolling_spend"
    settings = lake.with_job(job_name, max_files_per_trigger=1)
    landing, files = _staged(settings, tmp_path)

    def run():
        return run_stream(spark, settings, get_job(job_name, settings), available_now=True, progress=None,
                          install_signal_handlers=False)

    _arrive(files[:4], landing)
    run()
    sp = Savepoints(spark, settings, progress=None).create(get_job(job_name, settings))
    saved = {p.name for p in Path(sp.checkpoint).rglob("keys/*/*.parquet")}
    _arrive(files[4:], landing)
    run()
    live = {p.name for p in Path(settings.checkpoint_dir(job_name)).rglob("keys/*/*.parquet")}
    assert saved and not saved & live  # every file the savepoint named was merged into others and deleted since
    Savepoints(spark, settings, progress=None).restore(get_job(job_name, settings), sp.id)
    run()

    expected, _ = oj.rolling_spend_streamed(landing.parent, 1)
    got = [tuple(r) for r in spark.sql(oj.ROLLING_SPEND_ROWS).collect()]
    assert len(got) == len(set(got)), "a row was written twice"
    assert set(got) == expected and expected
