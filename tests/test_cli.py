"""CLI errors are one line on stderr with a non-zero exit, never a stack trace."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def lakestream(*args: str, env: dict | None = None, home: str = "/tmp/lakestream-cli-test") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lakestream.cli", "--home", home, *args],
        capture_output=True, text=True, timeout=120, env=env or dict(os.environ),
    )


def assert_one_line_error(result: subprocess.CompletedProcess, phrase: str) -> None:
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("lakestream: error:")
    assert phrase in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


def test_unknown_job_names_the_known_jobs():
    assert_one_line_error(lakestream("run", "purchase_metric"), "unknown job 'purchase_metric'; known jobs: decline_velocity,")


def test_several_jobs_run_together_but_a_savepoint_restores_one():
    assert_one_line_error(lakestream("run", "purchase_metrics", "no_such_job"), "unknown job 'no_such_job'")
    assert_one_line_error(lakestream("run", "purchase_metrics", "decline_velocity", "--from-savepoint", "x"),
                          "--from-savepoint restores one job")


@pytest.mark.parametrize(
    "start, end, phrase",
    [("2026-11-21", "2026-11-20", "is not after --start"), ("yesterday", "2026-11-20", "ISO-8601"), ("2026-11-20", "2026-13-01", "--end")],
)
def test_bad_date_range(start, end, phrase):
    assert_one_line_error(lakestream("backfill", "purchase_metrics", "--start", start, "--end", end), phrase)


def test_missing_java_is_reported_with_the_fix(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(tmp_path)  # no java here
    env["LAKESTREAM_BUNDLED_JAVA"] = "0"  # and not the virtualenv's JRE either
    result = lakestream("run", "purchase_metrics", env=env, home=str(tmp_path))
    assert_one_line_error(result, "Java 17 is required")
    assert "JAVA_HOME" in result.stderr


def test_too_old_java_is_refused(tmp_path):
    fake = tmp_path / "jdk" / "bin"
    fake.mkdir(parents=True)
    (fake / "java").write_text('#!/bin/sh\necho \'openjdk version "11.0.2" 2019-01-15\' >&2\n')
    (fake / "java").chmod(0o755)
    env = {**os.environ, "JAVA_HOME": str(tmp_path / "jdk")}
    assert_one_line_error(lakestream("run", "purchase_metrics", env=env, home=str(tmp_path)), "Java 11 is too old")


def test_missing_iceberg_jar_is_reported_with_the_fix(tmp_path):
    env = {**os.environ, "LAKESTREAM_ICEBERG_JAR": str(tmp_path / "missing.jar")}
    assert_one_line_error(lakestream("run", "purchase_metrics", env=env, home=str(tmp_path)), "does not exist; fix the path")


def test_bad_settings_file_names_the_key(tmp_path):
    (tmp_path / "lakestream.yaml").write_text("spark:\n  shuffle_partitions: lots\n")
    assert_one_line_error(lakestream("run", "purchase_metrics", home=str(tmp_path)), "spark.shuffle_partitions")


def test_a_misspelled_job_in_the_settings_is_refused_with_the_known_jobs(tmp_path):
    """Settings for a job the project does not have would apply to nothing, silently: refused in one line
    by every command that resolves jobs (the lake's folders are not even created)."""
    (tmp_path / "lakestream.yaml").write_text("jobs:\n  purchase_metric: {max_files_per_trigger: 2}\n")
    for args in (("jobs",), ("run", "decline_velocity")):
        result = lakestream(*args, home=str(tmp_path))
        assert_one_line_error(result, f"{tmp_path / 'lakestream.yaml'}: jobs: purchase_metric is not a job of project ")
        assert "its jobs are decline_velocity, " in result.stderr and "purchase_metrics" in result.stderr
        assert "fix the name, or remove the block" in result.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_unknown_option_is_one_line():
    assert_one_line_error(lakestream("run", "purchase_metrics", "--fast"), "unrecognized arguments: --fast")


def test_jobs_lists_the_registry():
    result = lakestream("jobs")
    assert result.returncode == 0
    assert "purchase_metrics" in result.stdout and "lake.payments.purchase_metrics" in result.stdout
