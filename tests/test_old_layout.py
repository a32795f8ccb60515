"""A checkpoint and a savepoint written by lakestream before its modules moved into folders resume after
the move: the code of the last commit before the move (``BEFORE_MOVE``, taken from this repository's
history) streams two jobs and takes their savepoints; then today's code resumes the windowed job from its
checkpoint and restores the keyed job from its savepoint, over more input. Each table ends as its plain-
Python oracle says, nothing doubled, nothing lost."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from lakestream.generator import generate
from tests import oracle
from tests import oracle_jobs as oj
from tests.conftest import SMALL

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BEFORE_MOVE = "d2c33d6"  # "README, bench/README: make bench 11:35 on 828c674 ...": the flat streaming/ of 2026-11-26
K = 4  # files per micro-batch
DELAY = 5_000

DUMP = """
import json, sys
from streaming.settings import Settings
from streaming.spark.session import get_spark
spark = get_spark(Settings.load())
out = {
  "windows": [[r.user_id, r.ws, r.event_count, r.approved_count, r.declined_count, str(r.amount_sum)] for r in spark.sql(
      "SELECT user_id, unix_millis(window_start) ws, event_count, approved_count, declined_count, amount_sum "
      "FROM lake.payments.purchase_metrics").collect()],
  "late": [r.event_id for r in spark.sql("SELECT event_id FROM lake.payments.purchase_metrics_late").collect()],
  "alerts": [[r.card_id, r.event_id, r.previous_event_id] for r in spark.sql(
      "SELECT card_id, event_id, previous_event_id FROM lake.fraud.large_amount_alerts").collect()],
  "alerts_late": [r.event_id for r in spark.sql("SELECT event_id FROM lake.fraud.large_amount_alerts_late").collect()],
}
print("DUMP" + json.dumps(out))
"""


def _old_tree(tmp_path: Path) -> Path:
    target = tmp_path / "before-move"
    target.mkdir()
    archive = subprocess.run(["git", "archive", BEFORE_MOVE, "streaming", "batch", "orchestration"], cwd=ROOT,
                             capture_output=True)
    assert archive.returncode == 0, (
        f"this test needs the repository's history (git archive {BEFORE_MOVE}): {archive.stderr.decode()[-300:]}")
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def _run(code: list[str] | str, home: Path, pythonpath: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAKESTREAM_")}
    env["LAKESTREAM_HOME"] = str(home)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    argv = [sys.executable, "-c", code] if isinstance(code, str) else [sys.executable, *code]
    run = subprocess.run(argv, env=env, cwd=home.parent, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"{' '.join(argv[1:3])}...: {run.stdout[-1500:]}\n{run.stderr[-3000:]}"
    return run.stdout


def test_a_checkpoint_and_a_savepoint_of_the_flat_layout_resume_after_the_move(tmp_path):
    old = _old_tree(tmp_path)
    home = tmp_path / "lake"
    staging = tmp_path / "staging"
    generate(SMALL, staging, sources=("payments",))
    files = oracle.files_in_arrival_order(staging / "payments")
    landing = home / "landing" / "payments"
    landing.mkdir(parents=True)
    for p in files[: 2 * K]:
        shutil.copy2(p, landing / p.name)

    old_cli = "from streaming.cli import main; import sys, streaming; print('CODE', streaming.__file__); sys.exit(main(sys.argv[1:]))"
    said = _run(["-c", old_cli, "run", "purchase_metrics", "large_amount_alerts", "--available-now",
                 "--max-files-per-trigger", str(K)], home, old)
    assert f"CODE {old}/streaming/__init__.py" in said, "the first run must be the code before the move"
    savepoint = {}
    for job in ("purchase_metrics", "large_amount_alerts"):
        out = _run(["-c", old_cli, "savepoint", "create", job], home, old)
        savepoint[job] = next(line.split()[1] for line in out.splitlines() if line.startswith("savepoint "))

    for p in files[2 * K:]:  # more input arrives; today's code takes over
        shutil.copy2(p, landing / p.name)
    new_cli = ["-m", "lakestream.cli"]
    _run([*new_cli, "run", "purchase_metrics", "--available-now", "--max-files-per-trigger", str(K)], home)
    _run([*new_cli, "run", "large_amount_alerts", "--available-now", "--max-files-per-trigger", str(K),
          "--from-savepoint", savepoint["large_amount_alerts"]], home)
    dump = json.loads(_run(DUMP, home).split("DUMP", 1)[1])

    # purchase_metrics: exactly the windows an uninterrupted stream of K files per batch closes
    batches = [[line for p in files[i:i + K] for line in oracle.read_lines(p)] for i in range(0, len(files), K)]
    truth = oracle.replay_stream(batches)
    windows = {(u, ws): (n, a, d, Decimal(amount)) for u, ws, n, a, d, amount in dump["windows"]}
    assert len(windows) == len(dump["windows"]), "a window was written twice"
    assert windows == truth.closed
    assert sorted(dump["late"]) == sorted(truth.late_ids)

    # large_amount_alerts: the alerts among the on-time payments up to the final watermark
    batched = oj.batches(home / "landing", ["payments"], K)
    on_time, late, watermark = oj.keyed_truth(batched, lambda e: True, DELAY)
    expected = oj.large_amounts([e for e in on_time if e["t_ms"] <= watermark])
    alerts = [tuple(a) for a in dump["alerts"]]
    assert len(alerts) == len(set(alerts)), "an alert was written twice"
    assert set(alerts) == expected and expected
    assert sorted(dump["alerts_late"]) == sorted(late)
