"""On a real Spark standalone cluster (a master and two workers on loopback, from the pyspark
package): a windowed and a keyed job as streams and a bounded twin, against the same oracles as
in local mode. Slow: three extra JVMs and a driver process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from lakestream.generator import generate
from streaming.spark.standalone import standalone_cluster
from tests import oracle
from tests import oracle_jobs as oj
from tests.conftest import SMALL

pytestmark = pytest.mark.slow
K = 3
REPO = Path(__file__).resolve().parents[1]


def test_streams_and_a_backfill_on_a_standalone_cluster_equal_the_oracles(tmp_path):
    home = tmp_path / "lake"
    landing = home / "landing"
    generate(SMALL, landing)
    out = tmp_path / "result.json"
    with standalone_cluster(tmp_path / "cluster", workers=2, cores=1, memory="2g") as master:
        env = {**os.environ, "LAKESTREAM_SPARK_MASTER": master, "PYSPARK_PYTHON": sys.executable,
               "LAKESTREAM_HOME": str(home)}
        env.pop("LAKESTREAM_CONFIG", None)
        run = subprocess.run([sys.executable, "-m", "tests.cluster_driver", str(home), str(out), str(K),
                              SMALL.start.isoformat()], cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["master"] == master and result["executors"] >= 3  # the driver and two executors

    # windowed stream: the closed windows of the K-files-per-batch replay; late ids as the replay's
    files = oracle.files_in_arrival_order(landing / "payments")
    truth = oracle.replay_stream([[line for p in files[i:i + K] for line in oracle.read_lines(p)]
                                  for i in range(0, len(files), K)])
    windows = {(u, ws): (n, a, d, Decimal(s)) for u, ws, n, a, d, s in result["windows"]}
    assert len(windows) == len(result["windows"]) and windows == truth.closed and truth.closed
    assert sorted(result["late"]) == sorted(truth.late_ids)

    # keyed stream: the pattern over the on-time payments up to the final watermark
    batched = oj.batches(landing, ["payments"], K)
    on_time, late, watermark = oj.keyed_truth(batched, lambda e: True, 5_000)
    expected = oj.large_amounts([e for e in on_time if e["t_ms"] <= watermark])
    assert {tuple(r) for r in result["alerts"]} == expected and expected
    assert sorted(result["alerts_late"]) == sorted(late)

    # bounded twin: every valid event once, per window
    bounded = oracle.bounded_windows(landing / "payments")
    want = {(r.user_id, int(r.window_start_ms)): (r.event_count, r.approved_count, r.declined_count, Decimal(r.amount_sum))
            for r in bounded.itertuples()}
    assert {(u, ws): (n, a, d, Decimal(s)) for u, ws, n, a, d, s in result["bounded"]} == want
