"""CSV by header: a file's first line, when it names the columns, maps them to the source's fields by name
(in any order); a file without a header keeps positional fields; a header that lacks a field or names an
unknown column refuses its file into the quarantine with a reason naming them. Checked against plain
Python over the same files, in a bounded read and in a stream."""

from __future__ import annotations

import csv
from datetime import timedelta

from streaming.declaration import Agg, Field, Source, Table, Watermark, WindowedJob
from streaming.io.parse import parse_sources
from streaming.io.sources import read_all
from streaming.run.runner import run_stream
from streaming.windows import Tumbling
from tests.conftest import drop_job_tables

FIELDS = ("reading_id", "read_at", "device_id", "site", "temperature")
READINGS = Source(
    name="readings", format="csv", event_time="read_at", dedup_key="reading_id",
    fields=(Field("reading_id", "string", pattern=r"^r-[0-9]+$"), Field("read_at", "timestamp"),
            Field("device_id", "string", pattern=r"^dev-[0-9]{3}$"), Field("site", "enum", choices=("north", "south")),
            Field("temperature", "double")),
)
JOB = WindowedJob(name="csv_header_test", sources=(READINGS,), keys=("device_id",), window=Tumbling(timedelta(minutes=5)),
                  watermark=Watermark(timedelta(seconds=5)), transform=lambda f: f, aggregates=(Agg.count("readings"),),
                  sink=Table("lake.test.csv_header"))


def record(i: int, device: str, site: str, minute: int) -> dict:
    return {"reading_id": f"r-{i}", "read_at": f"2026-11-20T10:{minute:02d}:00Z", "device_id": device, "site": site,
            "temperature": str(20 + i)}


FILES = {
    # (header: the column order written first, or None), records
    "a-declared.csv": (list(FIELDS), [record(1, "dev-001", "north", 1), record(2, "dev-002", "south", 2)]),
    "b-swapped.csv": (["reading_id", "read_at", "site", "device_id", "temperature"],
                      [record(3, "dev-003", "north", 3), record(4, "dev-001", "south", 4)]),
    "c-no-header.csv": (None, [record(5, "dev-002", "north", 5)]),
    "d-unknown.csv": (["reading_id", "read_at", "device", "site", "temperature", "humidity"],
                      [record(6, "dev-003", "north", 6)]),
    "e-later.csv": (list(FIELDS), [record(7, "dev-009", "south", 20)]),  # (moves the watermark past the others)
}


def write_files(folder) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, (header, records) in FILES.items():
        order = header or list(FIELDS)
        with open(folder / name, "w", newline="") as f:
            out = csv.writer(f, lineterminator="\n")
            if header:
                out.writerow(header)
            for r in records:
                out.writerow([r.get(c, r.get("device_id") if c == "device" else "55") for c in order])


def oracle():
    """What each file's lines are, by plain Python: records by name, or the refusal of the whole file."""
    valid, refused = {}, {}
    for name, (header, records) in FILES.items():
        if header and sorted(header) != sorted(FIELDS):
            unknown = [c for c in header if c not in FIELDS]
            missing = [c for c in FIELDS if c not in header]
            refused[name] = (len(records) + 1, unknown, missing)
            continue
        for r in records:
            valid[r["reading_id"]] = (r["device_id"], r["site"], float(r["temperature"]))
    return valid, refused


def test_csv_columns_are_matched_by_their_file_header_and_a_header_that_does_not_fit_refuses_its_file(spark, lake):
    write_files(lake.home / "landing" / "readings")
    valid, refused = oracle()
    parsed = parse_sources(JOB, read_all(spark, lake, JOB)).collect()
    good = {r.reading_id: (r.device_id, r.site, r.temperature) for r in parsed if r._reason is None}
    assert good == valid
    bad = [r for r in parsed if r._reason is not None]
    assert len(bad) == sum(n for n, _, _ in refused.values())
    for r in bad:
        name = r.source_file.rsplit("/", 1)[-1]
        count, unknown, missing = refused[name]
        assert r._reason.startswith("CSV header names unknown column(s) " + ", ".join(unknown) + " and lacks "
                                    + ", ".join(missing) + ": the file is refused"), r._reason

    # the same as a stream: the windows count the readings by name, the refused file is in the quarantine
    drop_job_tables(spark, namespaces=("test", "quarantine"))
    run_stream(spark, lake, JOB, available_now=True, progress=None, install_signal_handlers=False)
    counts = {}
    for r in spark.table("lake.test.csv_header").collect():
        counts[r.device_id] = counts.get(r.device_id, 0) + r.readings
    expected = {}
    for reading, (device, _, _) in valid.items():
        if reading != "r-7":  # (its window is still open when the input ends)
            expected[device] = expected.get(device, 0) + 1
    assert counts == expected
    assert spark.table("lake.test.csv_header_late").count() == 0
    quarantined = spark.table("lake.quarantine.readings").collect()
    assert sum(r.occurrences for r in quarantined) == sum(n for n, _, _ in refused.values())
    assert {r.source_file.rsplit("/", 1)[-1] for r in quarantined} == set(refused)
