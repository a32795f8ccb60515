"""docs/tables.md's snippets run as they are, against a lake streamed here in both formats, and what they
read agrees with plain Python over the landing files and with the other readers."""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import replace
from pathlib import Path

import pytest

from streaming.project import get_job
from streaming.run.runner import run_stream
from tests import oracle
from tests.conftest import write_config

DOC = Path(__file__).resolve().parents[1] / "docs" / "tables.md"


def _snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_tables_doc_snippets_read_what_the_stream_wrote(spark, small_landing, monkeypatch):
    pytest.importorskip("pyiceberg", reason="the test extra installs pyiceberg")
    pytest.importorskip("duckdb", reason="the test extra installs duckdb")
    settings = write_config(small_landing, jobs={"purchase_metrics": {  # (some events late, for the late table)
        "allowed_lateness": "0s", "out_of_orderness": "5s", "max_files_per_trigger": 2}})
    job = get_job("purchase_metrics", settings)
    run_stream(spark, settings, job, available_now=True, progress=None, install_signal_handlers=False)
    delta = replace(settings, format="delta", checkpoints=str(settings.home / "checkpoints-delta"))
    run_stream(spark, delta, job, available_now=True, progress=None, install_signal_handlers=False)

    monkeypatch.setenv("LAKESTREAM_HOME", str(settings.home))
    snippets = _snippets()
    assert len(snippets) == 4, "pandas, DuckDB, Spark, Delta"
    scope: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for code in snippets:
            exec(compile(code, str(DOC), "exec"), scope)  # noqa: S102 - the doc's own code

    windows, bad, late, per_file = scope["windows"], scope["bad"], scope["late"], scope["per_file"]
    # the quarantine holds every invalid line of the landing files (plain Python), once, with a reason
    lines = [line for path in oracle.files_in_arrival_order(Path(settings.landing_dir("payments")))
             for line in oracle.read_lines(path)]
    invalid = sum(oracle.validate(line) is None for line in lines)
    assert invalid > 0 and int(bad.occurrences.sum()) == invalid
    assert bad.reason.notna().all() and set(bad.detected_by) == {"purchase_metrics"}
    # the windows read without Spark are Spark's rows, and the Delta table's: one job, one input, three readers
    by_spark = {(r.user_id, r.window_start.timestamp(), r.event_count)
                for r in spark.table("lake.payments.purchase_metrics").collect()}
    as_read = {(r.user_id, r.window_start.timestamp(), r.event_count) for r in windows.itertuples()}
    in_delta = {(r.user_id, r.window_start.timestamp(), r.event_count) for r in scope["delta_windows"].itertuples()}
    assert as_read and as_read == by_spark == in_delta
    # every window read is the oracle's over all events, or short by its late events (the late table names them)
    truth = oracle.bounded_windows(Path(settings.landing_dir("payments")))
    counts = {(r.user_id, r.window_start_ms): r.event_count for r in truth.itertuples()}
    late_per_window = late.to_pandas().groupby(["user_id", "window_start"]).size()
    for r in windows.itertuples():
        key = (r.user_id, int(r.window_start.timestamp() * 1000))
        missed = int(late_per_window.get((r.user_id, r.window_start), 0))
        assert r.event_count + missed == counts[key], key
    # DuckDB's per-file counts add up to the late table
    assert int(per_file.late_rows.sum()) == late.num_rows > 0
    assert "windows" in printed.getvalue()
