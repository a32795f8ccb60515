"""The driver JVM's class-data archive: recorded once by the first process, mapped by later ones, never a
reason for a process to fail (a damaged archive is not mapped, a killed recorder does not block the next)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from streaming.settings import Settings
from streaming.spark import classarchive

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import json
from streaming.settings import Settings
from streaming.spark.session import get_spark
spark = get_spark(Settings.load())
bean = spark._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
print(json.dumps({"sum": spark.range(1000).selectExpr("sum(id) AS s").first().s,
                  "args": [str(a) for a in bean.getInputArguments()]}))
"""


def _run(tmp_path: Path, **extra) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAKESTREAM_")}
    env.update(LAKESTREAM_HOME=str(tmp_path / "home"), LAKESTREAM_CACHE=str(tmp_path / "cache"),
               LAKESTREAM_SPARK_MASTER="local[1]", **extra)
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                          cwd=str(ROOT))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def _option(args: list[str], name: str) -> str | None:
    return next((a.split("=", 1)[1] for a in args if a.startswith(f"-XX:{name}=")), None)


@pytest.mark.slow
def test_the_first_process_records_the_archive_and_later_ones_map_it(tmp_path):
    cache = tmp_path / "cache"
    first, err = _run(tmp_path)
    assert first["sum"] == sum(range(1000))
    assert _option(first["args"], "ArchiveClassesAtExit") and _option(first["args"], "SharedArchiveFile") is None
    assert "writing the JVM's class archive" in err
    archives = sorted(cache.glob("jvm-classes-*.jsa"))
    assert len(archives) == 1 and archives[0].stat().st_size > 1 << 20
    assert not list(cache.glob("*.partial")) and not list(cache.glob("*.recording"))  # nothing left behind

    second, err = _run(tmp_path)
    assert second["sum"] == sum(range(1000))
    assert _option(second["args"], "SharedArchiveFile") == str(archives[0])
    assert _option(second["args"], "ArchiveClassesAtExit") is None and "class archive" not in err

    # A damaged archive (cut short: a JVM that mapped it would crash) is not mapped; it is recorded again.
    os.chmod(archives[0], 0o600)
    with open(archives[0], "r+b") as f:
        f.truncate(archives[0].stat().st_size // 2)
    third, err = _run(tmp_path)
    assert third["sum"] == sum(range(1000))
    assert _option(third["args"], "SharedArchiveFile") is None and _option(third["args"], "ArchiveClassesAtExit")
    fourth, _ = _run(tmp_path)
    assert _option(fourth["args"], "SharedArchiveFile") == str(archives[0])

    # A flight recording (a profiler's hook on class loading) with the archive mapped crashed Java 17 at startup:
    # such a JVM starts without it, and records nothing.
    recording = tmp_path / "run.jfr"
    profiled, _ = _run(tmp_path, LAKESTREAM_JVM_OPTIONS=f"-XX:StartFlightRecording=filename={recording},duration=60s")
    assert profiled["sum"] == sum(range(1000))
    assert _option(profiled["args"], "SharedArchiveFile") is None and _option(profiled["args"], "ArchiveClassesAtExit") is None
    assert recording.is_file()

    off, err = _run(tmp_path, LAKESTREAM_CLASS_ARCHIVE="0")
    assert off["sum"] == sum(range(1000))
    assert _option(off["args"], "SharedArchiveFile") is None and _option(off["args"], "ArchiveClassesAtExit") is None


def _settings(tmp_path: Path) -> Settings:
    return Settings.load({"LAKESTREAM_HOME": str(tmp_path / "home"), "LAKESTREAM_CACHE": str(tmp_path / "cache")})


def test_one_process_records_at_a_time_and_a_dead_recorders_lock_is_taken_over(tmp_path):
    from streaming.spark.session import spark_conf

    settings = _settings(tmp_path)
    conf = spark_conf(settings)
    first = classarchive.record(settings, conf)
    assert first is not None and first.lock.read_text() == str(os.getpid())
    assert classarchive.record(settings, conf) is None  # this (live) process holds the lock

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    first.lock.write_text(dead.stdout.strip())  # a recorder that was killed before it could clean up
    first.partial.write_bytes(b"cut short")
    again = classarchive.record(settings, conf)
    assert again is not None and not first.partial.exists()
    assert classarchive.use(settings, conf) is None  # nothing published yet: nothing mapped


def _published(tmp_path: Path):
    """Settings, their Spark conf and a (tiny) archive published for them, as a recording leaves it."""
    from streaming.spark.session import spark_conf

    settings = _settings(tmp_path)
    conf = spark_conf(settings)
    recording = classarchive.record(settings, conf)
    recording.archive.write_bytes(b"x" * 100)
    recording.archive.with_suffix(".size").write_text("100\n")
    os.chmod(recording.archive, 0o644)
    return settings, conf, recording


def test_an_archive_others_can_write_or_of_another_size_is_not_mapped(tmp_path):
    from streaming.spark.session import spark_conf

    settings, conf, recording = _published(tmp_path)
    assert classarchive.use(settings, conf) == str(recording.archive)
    assert "-XX:SharedArchiveFile=" in spark_conf(settings)["spark.driver.extraJavaOptions"]
    os.chmod(recording.archive, 0o666)
    assert classarchive.use(settings, conf) is None
    os.chmod(recording.archive, 0o644)
    recording.archive.with_suffix(".size").write_text("99\n")
    assert classarchive.use(settings, conf) is None
    assert "SharedArchiveFile" not in spark_conf(settings)["spark.driver.extraJavaOptions"]


def test_a_jvm_under_a_flight_recording_or_an_agent_neither_maps_nor_records_the_archive(tmp_path):
    settings, conf, recording = _published(tmp_path)
    recording.lock.unlink()
    for hook in ("-XX:StartFlightRecording=duration=30s", "-javaagent:/opt/agent.jar", "-agentpath:/opt/libprof.so",
                 "-agentlib:jdwp=transport=dt_socket"):
        hooked = {**conf, "spark.driver.extraJavaOptions": f"-Xss4m {hook}"}
        assert classarchive.use(settings, hooked) is None and classarchive.record(settings, hooked) is None
    assert classarchive.use(settings, {**conf, "spark.driver.extraJavaOptions": "-Xss4m -XX:+UseG1GC"}) == str(recording.archive)
