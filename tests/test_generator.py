"""The generator: deterministic, arrival-ordered, atomic, and its counts add up. No Spark."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime, timedelta

from lakestream.generator import GeneratorConfig, generate
from tests import oracle

CFG = GeneratorConfig(seed=3, duration=timedelta(minutes=10), rate=20, users=30, late_fraction=0.05,
                      late_min=timedelta(minutes=2), late_max=timedelta(minutes=5), duplicate_fraction=0.05,
                      malformed_fraction=0.02)


def _lines(folder):
    return [line for p in oracle.files_in_arrival_order(folder) for line in oracle.read_lines(p)]


def test_same_seed_same_bytes_and_rerun_leaves_files_alone(tmp_path):
    first = generate(CFG, tmp_path / "a")
    generate(CFG, tmp_path / "b")
    again = generate(CFG, tmp_path / "a")
    assert _lines(tmp_path / "a" / "payments") == _lines(tmp_path / "b" / "payments")
    assert again["payments"].files == 0 and again["payments"].files_skipped == len(first["payments"].file_names)
    other = generate(replace(CFG, seed=4), tmp_path / "c")
    assert _lines(tmp_path / "c" / "payments") != _lines(tmp_path / "a" / "payments")


def test_an_overlapping_run_never_overwrites_a_landing_file(tmp_path):
    """A second run over part of the same time (other content for the same minutes) adds files under
    new names: every byte a stream may already have read stays as it was."""
    generate(CFG, tmp_path)
    folder = tmp_path / "payments"
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.iterdir()}
    overlap = replace(CFG, start=CFG.start + timedelta(minutes=5), seed=CFG.seed)
    report = generate(overlap, tmp_path)["payments"]
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.iterdir()}
    assert {name: after[name] for name in before} == before
    assert report.files_renamed > 0
    renamed = [n for n in report.file_names if n not in before]
    assert renamed and all(n.endswith(("-2.jsonl", "-3.jsonl")) or n not in before for n in renamed)
    again = generate(overlap, tmp_path)["payments"]  # the same run again: nothing new
    assert again.files == 0 and again.files_renamed == 0
    assert {p.name for p in folder.iterdir()} == set(after)


def test_counts_add_up_and_files_are_in_arrival_order(tmp_path):
    report = generate(CFG, tmp_path)["payments"]
    folder = tmp_path / "payments"
    lines = _lines(folder)
    assert len(lines) == report.lines == report.events + report.duplicates + report.malformed
    valid = [oracle.validate(l) for l in lines]
    assert sum(v is None for v in valid) == report.malformed
    ids = [v["event_id"] for v in valid if v]
    assert len(ids) - len(set(ids)) == report.duplicates
    assert not list(folder.glob(".*")), "no temporary files are left behind"
    mtimes = [p.stat().st_mtime_ns for p in oracle.files_in_arrival_order(folder)]
    assert mtimes == sorted(mtimes) and len(set(mtimes)) == len(mtimes)


def test_late_events_land_in_later_files_and_the_rest_within_the_bound(tmp_path):
    report = generate(CFG, tmp_path)["payments"]
    files = oracle.files_in_arrival_order(tmp_path / "payments")
    very_late = 0
    for path in files:
        file_start = datetime.strptime(path.name.split("-")[2], "%Y%m%dT%H%M%SZ.jsonl").timestamp() * 1000
        for line in oracle.read_lines(path):
            event = oracle.validate(line)
            if event is None:
                continue
            lag = file_start - event["t_ms"]
            assert lag < 20 * 60 * 1000 + 60_000
            if lag >= 60_000:  # arrived in a file opened more than a minute after its event time
                very_late += 1
    assert very_late >= report.late * 0.8
    assert report.late > 0


def test_payment_records_follow_the_contract(tmp_path):
    generate(CFG, tmp_path)
    record = json.loads(oracle.read_lines(oracle.files_in_arrival_order(tmp_path / "payments")[0])[0])
    assert set(record) == {"event_id", "event_time", "card_id", "user_id", "merchant_id", "amount", "currency", "status"}
    assert record["event_time"].endswith("Z") and len(record["event_time"]) == 24
    login = json.loads(oracle.read_lines(oracle.files_in_arrival_order(tmp_path / "logins")[0])[0])
    assert set(login) == {"event_id", "event_time", "user_id", "status", "ip"}
