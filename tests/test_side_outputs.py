"""Side outputs on an interval (``run.side``): a windowed stream keeps its late rows and quarantined lines in its
checkpoint between commits, and every kept row reaches its table exactly once: at the interval, at the stop, after a
crash anywhere in a commit outside a batch, before a savepoint's copy. Checked against the plain-Python oracle."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from streaming.checkpoint.records import EngineState
from streaming.project import get_job
from streaming.run.runner import run_stream
from tests import oracle
from tests.conftest import SMALL, drop_job_tables, settings_for
from tests.logs import excerpt

JOB = "purchase_metrics"
LATE = "lake.payments.purchase_metrics_late"
QUARANTINE = "lake.quarantine.payments"
K = 3  # files per micro-batch (as test_purchase_metrics): the watermark moves, events turn late


def _batches(landing: Path) -> list[list[str]]:
    files = oracle.files_in_arrival_order(landing)
    return [[line for p in files[i:i + K] for line in oracle.read_lines(p)] for i in range(0, len(files), K)]


def _side_tables(spark) -> tuple[list[str], int]:
    late = [r.event_id for r in spark.table(LATE).collect()]
    quarantine = spark.sql(f"SELECT sum(occurrences) AS n FROM {QUARANTINE} WHERE detected_by = '{JOB}'").first().n
    return late, int(quarantine or 0)


def test_side_rows_kept_between_commits_reach_their_tables_once_at_the_stop(spark, tmp_path):
    """An interval longer than the run: no batch commits a side table, every batch keeps its rows (the records list
    them), and the stop commits them all, once, outside any batch: the tables equal the oracle's."""
    from lakestream.generator import generate

    drop_job_tables(spark)
    settings = settings_for(tmp_path / "home").with_job(JOB, max_files_per_trigger=K,
                                                         side_outputs_every=timedelta(hours=1))
    generate(SMALL, settings.landing, sources=("payments",))
    landing = Path(settings.landing_dir("payments"))
    points: list[tuple[str, int]] = []
    kept: list[int] = []
    state = EngineState(spark, settings.checkpoint_dir(JOB))

    def fault(point: str, batch_id: int) -> None:
        points.append((point, batch_id))
        if point == "after-state":
            kept.append(sum(p.rows for p in state.latest_record().pending))

    report = run_stream(spark, settings, get_job(JOB, settings), available_now=True, progress=None, fault=fault)
    truth = oracle.replay_stream(_batches(landing))
    assert truth.late_ids and truth.invalid_lines, "the input must make late rows and quarantined lines"
    in_batches = [p for p, _ in points if p in (f"committed:{LATE}", f"committed:{QUARANTINE}")]
    assert in_batches == [], "a batch committed a side table before the interval"
    last = report.last.batch_id
    assert (f"flushed:{LATE}", last) in points and (f"flushed:{QUARANTINE}", last) in points
    late, quarantined = _side_tables(spark)
    assert sorted(late) == sorted(truth.late_ids)
    assert quarantined == truth.invalid_lines
    rows = len(late) + spark.sql(f"SELECT count(*) AS n FROM {QUARANTINE} WHERE detected_by = '{JOB}'").first().n
    assert kept == sorted(kept) and kept[-1] == rows, kept  # each batch kept its own and the earlier ones'
    assert state.latest_record().pending == ()
    assert not list(Path(settings.checkpoint_dir(JOB)).glob("lakestream/side/*/*/*.parquet")), "kept files stay"
    # the written_by of lines committed outside a batch names that commit and the last batch
    stamps = {(r.written_by.split(":")[-2].endswith("~flush"), r.batch_id)
              for r in spark.sql(f"SELECT written_by, batch_id FROM {QUARANTINE}").collect()}
    assert stamps == {(True, last)}


def test_an_interval_of_zero_commits_the_side_tables_with_every_batch(spark, tmp_path):
    from lakestream.generator import generate

    drop_job_tables(spark)
    settings = settings_for(tmp_path / "home").with_job(JOB, max_files_per_trigger=K, side_outputs_every=timedelta(0))
    generate(SMALL, settings.landing, sources=("payments",))
    landing = Path(settings.landing_dir("payments"))
    points: list[str] = []
    run_stream(spark, settings, get_job(JOB, settings), available_now=True, progress=None,
               fault=lambda point, batch_id: points.append(point))
    truth = oracle.replay_stream(_batches(landing))
    assert f"committed:{LATE}" in points and not any(p.startswith("flushed:") for p in points)
    late, quarantined = _side_tables(spark)
    assert sorted(late) == sorted(truth.late_ids) and quarantined == truth.invalid_lines


def _child(home: Path, pause_at: str | None, pause_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "LAKESTREAM_PAUSE_DIR": str(pause_dir), "LAKESTREAM_PAUSE_SECONDS": "120"}
    env.pop("LAKESTREAM_PAUSE_AT", None)
    if pause_at:
        env["LAKESTREAM_PAUSE_AT"] = pause_at
    log = open(home / "child.log", "a")
    return subprocess.Popen([sys.executable, "-m", "lakestream.cli", "--home", str(home), "run", JOB, "--available-now"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.slow
@pytest.mark.parametrize("point,fmt", [(f"flushed:{LATE}", "iceberg"), ("before-flush-record", "delta")])
def test_sigkill_inside_the_commit_of_kept_side_rows_neither_loses_nor_repeats_one(spark, warehouse, tmp_path, point,
                                                                                  fmt):
    """Killed at the stop's commit of the kept side rows (after the late table's commit, the quarantine's not yet;
    or after both, before the record's rewrite), then run again: the next run finishes that commit (each table
    looked up) and the tables equal the oracle's, in Iceberg and in Delta."""
    from lakestream.generator import generate

    drop_job_tables(spark)
    home = tmp_path / "home"
    home.mkdir()
    (home / "lakestream.yaml").write_text(
        f"warehouse: {warehouse}\nformat: {fmt}\nspark: {{shuffle_partitions: 2}}\n"
        f"jobs: {{{JOB}: {{max_files_per_trigger: {K}, side_outputs_every: 1h}}}}\n")
    generate(SMALL, home / "landing", sources=("payments",))
    landing = home / "landing" / "payments"
    pause_dir = tmp_path / "pauses"
    proc = _child(home, point, pause_dir)
    deadline = time.monotonic() + 300
    while not any(pause_dir.glob(f"{point}@*")) and time.monotonic() < deadline:
        assert proc.poll() is None, excerpt(home / "child.log")
        time.sleep(0.2)
    assert any(pause_dir.glob(f"{point}@*")), excerpt(home / "child.log")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    again = _child(home, None, pause_dir)
    assert again.wait(timeout=300) == 0, excerpt(home / "child.log")
    truth = oracle.replay_stream(_batches(landing))
    if fmt == "iceberg":
        late, quarantined = _side_tables(spark)
    else:
        from deltalake import DeltaTable

        delta = home / "delta"
        late = [r["event_id"] for r in DeltaTable(str(delta / "payments" / "purchase_metrics_late")).to_pyarrow_table().to_pylist()]
        quarantined = sum(r["occurrences"] for r in DeltaTable(str(delta / "quarantine" / "payments")).to_pyarrow_table().to_pylist())
    assert len(late) == len(set(late)), "a late row was committed twice"
    assert sorted(late) == sorted(truth.late_ids)
    assert quarantined == truth.invalid_lines
    assert "side row(s) kept since batch" in (home / "child.log").read_text()  # the second run said what it committed
