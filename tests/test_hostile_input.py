"""A hostile landing zone: whatever reaches the folder, the stream keeps running, loses no good
record and quarantines every bad one with a reason. Oracle: the lines as Python splits the files
(good ones by the independent validator), so good + quarantined = lines read, on Iceberg and
Delta tables and on the keyed path."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from lakestream.generator import GeneratorConfig, generate
from streaming.project import get_job
from streaming.run.runner import run_stream
from streaming.io.tables import job_sinks
from tests import oracle
from tests.conftest import drop_job_tables, settings_for

GOOD = GeneratorConfig(seed=21, duration=timedelta(minutes=6), rate=5.0, users=20, late_fraction=0.0,
                       duplicate_fraction=0.02, malformed_fraction=0.0)


def _payment(**fields) -> str:
    record = {"event_id": "h-1", "event_time": "2026-11-20T00:03:00Z", "card_id": "c1", "user_id": "u1",
              "merchant_id": "m1", "amount": "12.50", "currency": "EUR", "status": "APPROVED"}
    record.update(fields)
    return json.dumps(record, ensure_ascii=False)


HOSTILE_TEXT = [
    _payment(event_id="h-overflow", amount="99999999999999999999999.99"),  # overflows decimal(18,2)
    _payment(event_id="h-exp", amount="1e400"),
    _payment(event_id="h-negative", amount="-5.00"),
    _payment(event_id="h-text", amount="twelve"),
    _payment(event_id="h-bool").replace('"12.50"', "true"),
    _payment(event_id="h-nan").replace('"12.50"', "NaN"),
    _payment(event_id="h-null-amount").replace('"12.50"', "null"),
    _payment(event_id="h-ünïcode", user_id="üser"),
    _payment(event_id="h-long-id", card_id="c" * 5000),
    _payment(event_id="h-feb30", event_time="2026-02-30T00:00:00Z"),
    _payment(event_id="h-epoch").replace('"2026-11-20T00:03:00Z"', "1795132980000"),
    _payment(event_id="h-null-time").replace('"2026-11-20T00:03:00Z"', "null"),
    "null",
    "[]",
    '"just a string"',
    "{",
    _payment(event_id="h-huge", merchant_id="m" * (3 * 1024 * 1024)),  # a 3 MB line
    "",
]
GARBAGE = [bytes(range(1, 10)) + bytes(range(14, 128)), b"\xff\xfe\xfa invalid utf-8 \xc3\x28", b"\x00\x00\x00"]


def _landing_lines(folder: Path) -> list[str]:
    """Every line Spark's text source reads, as Python reads it (undecodable bytes replaced)."""
    out = []
    for path in oracle.files_in_arrival_order(folder):
        text = path.read_bytes().decode("utf-8", errors="replace")
        lines = text.split("\n")
        out += lines[:-1] if lines and lines[-1] == "" else lines
    return out


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    settings = settings_for(tmp_path_factory.mktemp("hostile"))
    generate(GOOD, settings.landing, sources=("payments",))
    folder = Path(settings.landing_dir("payments"))
    generated_valid = sum(1 for line in _landing_lines(folder) if oracle.validate(line) is not None)
    last = max(p.stat().st_mtime for p in folder.iterdir())
    extra = {
        "payments-zz-hostile.jsonl": ("\n".join(HOSTILE_TEXT) + "\n").encode(),
        "payments-zz-garbage.jsonl": b"\n".join(GARBAGE) + b"\n",
        "payments-zz-empty.jsonl": b"",
        "payments-zz-no-final-newline.jsonl": _payment(event_id="h-last", event_time="2026-11-20T00:05:00Z").encode(),
    }
    for i, (name, data) in enumerate(extra.items()):
        (folder / name).write_bytes(data)
        os.utime(folder / name, (last + 1 + i, last + 1 + i))
    lines = _landing_lines(folder)
    valid = sum(1 for line in lines if oracle.validate(line) is not None)
    assert valid == generated_valid + 1  # the oracle rejects every hostile line; the unterminated last line is good
    return settings, lines, valid


@pytest.mark.parametrize("job_name,fmt", [("purchase_metrics", "iceberg"), ("purchase_metrics", "delta"),
                                          ("large_amount_alerts", "iceberg")])
def test_every_line_is_either_an_event_or_quarantined_with_a_reason(spark, hostile, tmp_path, job_name, fmt):
    settings, lines, valid = hostile
    drop_job_tables(spark)
    settings = replace(settings, format=fmt, checkpoints=str(tmp_path / "checkpoints"), delta_root=str(tmp_path / "delta"))
    settings = settings.with_job(job_name, max_files_per_trigger=3)
    job = get_job(job_name, settings)
    report = run_stream(spark, settings, job, available_now=True, progress=None, install_signal_handlers=False)

    assert report.stats.lines == len(lines)
    assert report.stats.lines - report.stats.quarantined == valid  # no good record lost, no bad one let in
    quarantine = job_sinks(spark, settings, job, create=False).quarantine["payments"].read()
    kept = quarantine.selectExpr("sum(occurrences) AS n", "count_if(reason IS NULL OR reason = '') AS blank").first()
    assert kept.n == len(lines) - valid and kept.blank == 0
    reasons = {r.reason.split(" (")[0].split(":")[0] for r in quarantine.select("reason").collect()}
    assert {"malformed JSON", "invalid amount", "invalid event_time", "missing field amount"} <= reasons


def test_a_file_that_vanishes_between_planning_and_reading_does_not_stop_the_stream(spark, tmp_path):
    """A producer deletes a landing file after Spark planned the batch that reads it: the batch goes
    on with the other files, and every line that was there to read is an event or quarantined."""
    from tests.conftest import SMALL

    settings = settings_for(tmp_path).with_job("purchase_metrics", max_files_per_trigger=3)
    drop_job_tables(spark)
    generate(SMALL, settings.landing, sources=("payments",))
    files = oracle.files_in_arrival_order(Path(settings.landing_dir("payments")))
    victim = files[4]  # read by batch 1 (3 files a batch)

    def delete_at_start(point: str, batch_id: int) -> None:
        if point == "batch-start" and batch_id == 1 and victim.exists():
            victim.unlink()

    report = run_stream(spark, settings, get_job("purchase_metrics", settings), available_now=True, progress=None,
                        install_signal_handlers=False, fault=delete_at_start)
    assert not victim.exists()
    remaining = [line for p in files if p != victim for line in oracle.read_lines(p)]
    valid = sum(1 for line in remaining if oracle.validate(line) is not None)
    assert report.stats.lines == len(remaining) and report.stats.lines - report.stats.quarantined == valid


def test_a_file_truncated_between_planning_and_reading_keeps_the_stream_going(spark, tmp_path):
    """A producer cuts a landing file short (mid-line) after Spark planned the batch that reads it: the
    batch reads what is there, the cut line is quarantined, and inspection names the file as changed
    after it was read."""
    from streaming.checkpoint.inspect import inspect_job
    from tests.conftest import SMALL

    settings = settings_for(tmp_path).with_job("purchase_metrics", max_files_per_trigger=3)
    drop_job_tables(spark)
    generate(SMALL, settings.landing, sources=("payments",))
    files = oracle.files_in_arrival_order(Path(settings.landing_dir("payments")))
    victim = files[4]
    cut = len(victim.read_bytes()) // 2

    def truncate_at_start(point: str, batch_id: int) -> None:
        if point == "batch-start" and batch_id == 1 and victim.stat().st_size > cut:
            with open(victim, "r+b") as f:
                f.truncate(cut)

    job = get_job("purchase_metrics", settings)
    report = run_stream(spark, settings, job, available_now=True, progress=None, install_signal_handlers=False,
                        fault=truncate_at_start)
    lines = _landing_lines(Path(settings.landing_dir("payments")))
    valid = sum(1 for line in lines if oracle.validate(line) is not None)
    assert report.stats.lines == len(lines) and report.stats.lines - report.stats.quarantined == valid
    assert oracle.validate(oracle.read_lines(victim)[-1]) is None  # the cut line went to quarantine
    health = inspect_job(settings, job).health
    assert health.rewritten and any(victim.name in m for m in health.messages)
