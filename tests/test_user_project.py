"""Your own data: a project outside lakestream (the sensors example, CSV landing files), a Parquet
source, every declared field type, and the loader's one-line errors.

Oracles: plain Python over the same records (the validity rules written out again, a replay of the
stream's batches with the watermark rule, the alert rule), never lakestream's own output."""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import subprocess
import sys
from collections import defaultdict
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import pandas as pd
import pytest

from streaming.declaration import Agg, Field, Source, Table, Watermark, WindowedJob
from streaming.errors import ProjectError
from streaming.project import load
from lakestream.testing import JobHarness
from streaming.windows import Tumbling
from tests.logs import excerpt

REPO = Path(__file__).resolve().parents[1]
SENSORS = REPO / "examples" / "sensors"


# ---- the loader's errors (no Spark) -----------------------------------------------------------------

def _project(tmp_path: Path, name: str, files: dict[str, str]) -> Path:
    root = tmp_path / name
    for rel, text in {"__init__.py": "", "jobs/__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


SOURCE = """
from streaming.declaration import Field, Source
EVENTS = Source(name="{name}", fields=(Field("event_id", "string"), Field("event_time", "timestamp"),
                                       Field("device", "string"), Field("value", "double")))
"""
JOB = """
from datetime import timedelta
from streaming.declaration import Agg, Table, Watermark, WindowedJob
from streaming.windows import Tumbling
from tests.logs import excerpt
from ..sources import EVENTS
JOB = WindowedJob(name="{job}", sources=(EVENTS,), keys=("device",), window=Tumbling(timedelta(minutes=1)),
                  watermark=Watermark(timedelta(seconds=5)), transform=lambda f: f,
                  aggregates=(Agg.sum("value", "total"),), sink=Table("lake.mine.{job}"))
"""


def test_a_project_folder_is_loaded_and_its_mistakes_are_one_line_errors(tmp_path):
    good = load(str(_project(tmp_path, "proj_good", {"sources.py": SOURCE.format(name="events"),
                                                      "jobs/totals.py": JOB.format(job="totals")})))
    assert list(good.jobs) == ["totals"] and list(good.sources) == ["events"]

    broken = _project(tmp_path, "proj_broken", {"sources.py": SOURCE.format(name="events"),
                                                "jobs/totals.py": "import not_a_module_anywhere\n"})
    with pytest.raises(ProjectError, match=r"does not import: proj_broken\.jobs\.totals: ModuleNotFoundError: "
                                           r"No module named 'not_a_module_anywhere' \(.*totals\.py:1\)"):
        load(str(broken))
    twice = _project(tmp_path, "proj_twice", {"sources.py": SOURCE.format(name="events"),
                                              "jobs/a.py": JOB.format(job="totals"), "jobs/b.py": JOB.format(job="totals")})
    with pytest.raises(ProjectError, match=r"two jobs are named 'totals' \(proj_twice\.jobs\.a and proj_twice\.jobs\.b\)"):
        load(str(twice))
    unread = _project(tmp_path, "proj_unread", {
        "sources.py": SOURCE.format(name="events") + SOURCE.format(name="spare").replace("EVENTS", "SPARE"),
        "jobs/totals.py": JOB.format(job="totals")})
    with pytest.raises(ProjectError, match=r"source\(s\) spare declared in proj_unread\.sources but read by no job"):
        load(str(unread))
    unknown = _project(tmp_path, "proj_unknown", {
        "sources.py": SOURCE.format(name="events"),
        "jobs/totals.py": JOB.format(job="totals").replace("from ..sources import EVENTS", SOURCE.format(name="other"))})
    with pytest.raises(ProjectError, match=r"job totals \(proj_unknown\.jobs\.totals\) reads source 'other', which "
                                           r"proj_unknown\.sources does not declare \(it declares events\)"):
        load(str(unknown))
    empty = _project(tmp_path, "proj_empty", {"sources.py": ""})
    with pytest.raises(ProjectError, match="declares no job"):
        load(str(empty))


def test_the_cli_names_a_broken_project_in_one_line_and_lists_a_good_ones_jobs(tmp_path):
    from tests.test_cli import assert_one_line_error, lakestream

    broken = _project(tmp_path, "cli_broken", {"jobs/x.py": "raise RuntimeError('boom in my job')\n"})
    result = lakestream("jobs", env={**os.environ, "LAKESTREAM_PROJECT": str(broken)}, home=str(tmp_path / "h"))
    assert_one_line_error(result, "does not import: cli_broken.jobs.x: RuntimeError: boom in my job")
    missing = lakestream("jobs", env={**os.environ, "LAKESTREAM_PROJECT": str(tmp_path / "nowhere")}, home=str(tmp_path))
    assert_one_line_error(missing, "lakestream new")
    listed = lakestream("jobs", env={**os.environ, "LAKESTREAM_PROJECT": str(SENSORS)}, home=str(tmp_path / "h"))
    assert listed.returncode == 0, listed.stderr
    assert "device_temperature" in listed.stdout and "overheat_alerts" in listed.stdout
    assert "purchase_metrics" not in listed.stdout


def test_declarations_refuse_bad_fields_and_sources():
    from streaming.errors import DeclarationError

    with pytest.raises(DeclarationError, match="unknown type 'float'"):
        Field("x", "float")
    with pytest.raises(DeclarationError, match="decimal"):
        Field("x", "decimal(40,2)")
    with pytest.raises(DeclarationError, match="a pattern applies to string fields"):
        Field("x", "int", pattern="^[0-9]+$")
    with pytest.raises(DeclarationError, match="must be a timestamp"):
        Source("s", (Field("event_id", "string"), Field("event_time", "string")))
    with pytest.raises(DeclarationError, match="format must be one of json, csv, parquet"):
        Source("s", (Field("event_id", "string"), Field("event_time", "timestamp")), format="xml")
    with pytest.raises(DeclarationError, match="must be required"):
        Source("s", (Field("event_id", "string", required=False), Field("event_time", "timestamp")))


# ---- every field type, one rule at a time (JSON lines) -----------------------------------------------

TYPED = Source(name="typed", fields=(
    Field("event_id", "string"), Field("event_time", "timestamp"),
    Field("n", "int", required=False), Field("big", "long", required=False), Field("x", "double", required=False),
    Field("price", "decimal(6,3)", required=False), Field("flag", "boolean", required=False),
    Field("day", "date", required=False), Field("code", "string", pattern=r"^[A-Z]{2}$", required=False),
    Field("tier", "enum", choices=("GOLD", "BASIC"), required=False), Field("ip", "ip", required=False),
    Field("must", "string")))
TYPED_JOB = WindowedJob(name="typed_counts", sources=(TYPED,), keys=("must",), window=Tumbling(timedelta(minutes=5)),
                        watermark=Watermark(timedelta(seconds=0)), transform=lambda f: f,
                        aggregates=(Agg.count("events"),), sink=Table("lake.test.typed_counts"))

# (field, JSON value, valid?)
CASES = [
    ("n", "12", True), ("n", "-7", True), ("n", '"42"', True), ("n", "1.5", False), ("n", "3000000000", False),
    ("n", '"x"', False), ("big", "3000000000", True), ("big", "99999999999999999999", False),
    ("x", "2.5e3", True), ("x", "-0.25", True), ("x", '"NaN"', False), ("x", '"abc"', False), ("x", "1e999", False),
    ("price", "123.456", True), ("price", "-1.5", True), ("price", "1234.5", False), ("price", "1.2345", False),
    ("flag", "true", True), ("flag", '"FALSE"', True), ("flag", '"yes"', False), ("flag", "1", False),
    ("day", '"2026-02-28"', True), ("day", '"2026-02-30"', False), ("day", '"28/02/2026"', False),
    ("code", '"AB"', True), ("code", '"abc"', False), ("tier", '"GOLD"', True), ("tier", '"gold"', False),
    ("ip", '"10.0.0.1"', True), ("ip", '"10.0.0.256"', False),
    ("n", "null", True), ("must", "null", False),
]


def test_every_field_type_is_checked_as_declared(spark, tmp_path):
    lines = []
    for i, (name, value, _) in enumerate(CASES):
        record = {"event_id": f"e{i}", "event_time": "2026-11-20T10:00:00Z", "must": "m"}
        text = json.dumps(record)[:-1] + f', "{name}": {value}}}'
        lines.append(text)
    lines.append('{"event_id": "e-missing", "event_time": "2026-11-20T10:00:00Z"}')  # `must` missing
    harness = JobHarness(TYPED_JOB, tmp_path)
    out = harness.stream([lines])
    bad = dict(zip(out.quarantine["raw_line"].map(lambda t: json.loads(t)["event_id"]), out.quarantine["reason"]))
    for i, (name, value, valid) in enumerate(CASES):
        assert (f"e{i}" not in bad) == valid, (name, value, bad.get(f"e{i}"))
        if not valid:
            assert name in bad[f"e{i}"], bad[f"e{i}"]
    assert bad["e-missing"] == "missing field must"
    assert len(bad) == sum(1 for c in CASES if not c[2]) + 1
    # every valid record counted once in its window (the window closes at end of input: bounded twin)
    twin = harness.bounded()
    assert int(twin.main["events"].sum()) == sum(1 for c in CASES if c[2])


# ---- the sensors project: CSV landing files, a sliding window and a keyed alert ----------------------

_RID, _DEV = re.compile(r"^r-[0-9a-f]{1,32}$"), re.compile(r"^dev-[0-9]{3}$")
_TS = re.compile(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?(Z|[+-][0-9]{2}:[0-9]{2})$")
_DBL = re.compile(r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]{1,3})?$")
_HUM = re.compile(r"^[+-]?[0-9]{1,3}(\.[0-9]{1,2})?$")


def valid_reading(line: str) -> dict | None:
    """The sensors source's rules, written out again in plain Python."""
    parts = line.split(",")
    if len(parts) != 7:
        return None
    rid, dev, site, at, temp, hum, ok = parts
    if not (_RID.match(rid) and _DEV.match(dev) and site in ("north", "south", "east") and _TS.match(at)
            and _DBL.match(temp) and (hum == "" or _HUM.match(hum)) and ok.lower() in ("true", "false")):
        return None
    t = datetime.fromisoformat(at.replace("Z", "+00:00"))
    return {"id": rid, "device": dev, "site": site, "t": t, "ms": int(t.timestamp() * 1000), "temp": float(temp)}


def _sensor_batches(tmp_path: Path, minutes: int = 14, devices: int = 4) -> list[list[str]]:
    sys.path.insert(0, str(SENSORS.parent))
    generate = importlib.import_module("sensors.generate").generate
    out = generate(tmp_path / "gen", minutes=minutes, devices=devices)
    assert out.bad == 4 and out.late > 0
    return [f.read_text().splitlines()[1:] for f in sorted(out.files)]


def replay_sliding(batches, size_ms, every_ms, delay_ms):
    """Windows fired by the end of the stream and the late (event, window) pairs, batch by batch."""
    seen, windows, late = set(), defaultdict(list), []
    w = -(2**62)
    for batch in batches:
        events = []
        for line in batch:
            r = valid_reading(line)
            if r and r["id"] not in seen:
                seen.add(r["id"])
                events.append(r)
        for r in events:
            last = r["ms"] - r["ms"] % every_ms
            for start in range(last, r["ms"] - size_ms, -every_ms):
                if start + size_ms <= w:
                    late.append((r["id"], start))
                else:
                    windows[(r["device"], start)].append(r["temp"])
        if events:
            w = max(w, max(r["ms"] for r in events) - delay_ms)
    fired = {k: v for k, v in windows.items() if k[1] + size_ms <= w}
    return fired, late, w


def overheat_oracle(readings, threshold=80.0, hold_ms=5 * 60_000, until_ms=None):
    """(device, alert time) of every spell hot in each reading for ``hold_ms``, up to ``until_ms``."""
    alerts = []
    by_device = defaultdict(list)
    for r in readings:
        by_device[r["device"]].append(r)
    for device, rows in by_device.items():
        since, alerted = None, False
        for r in sorted(rows, key=lambda r: (r["ms"], r["id"])):
            if since is not None and not alerted and r["ms"] > since + hold_ms:
                alerts.append((device, since + hold_ms))  # the timer fires before any later reading
                alerted = True
            if r["temp"] > threshold:
                if since is None:
                    since, alerted = r["ms"], False
            else:
                since, alerted = None, False
        if since is not None and not alerted:
            alerts.append((device, since + hold_ms))
    return sorted(a for a in alerts if until_ms is None or a[1] <= until_ms)


def test_sensors_project_windows_stream_and_twin_against_the_oracle(spark, tmp_path):
    project = load(str(SENSORS))
    job = project.jobs["device_temperature"]
    batches = _sensor_batches(tmp_path)
    harness = JobHarness(job, tmp_path)
    out = harness.stream(batches)
    fired, late, w = replay_sliding(batches, 10 * 60_000, 60_000, 30_000)
    got = {(r.device_id, int(r.window_start.timestamp() * 1000)): (r.readings, r.temperature_sum, r.temperature_min,
                                                                      r.temperature_max)
           for r in out.main.itertuples()}
    assert set(got) == set(fired) and len(got) > 20
    for key, temps in fired.items():
        n, total, low, high = got[key]
        assert n == len(temps) and math.isclose(total, sum(temps), rel_tol=1e-9) and (low, high) == (min(temps), max(temps))
    assert sorted(zip(out.late["reading_id"], out.late["window_start"].map(lambda t: int(t.timestamp() * 1000)))) \
        == sorted(late) and late
    assert int(out.watermarks[-1].timestamp() * 1000) == w
    assert sorted(out.quarantine["reason"]) == sorted([
        "invalid temperature (expected double): hot", "missing field device_id",
        "invalid site (expected one of north|south|east): west", "malformed CSV: not 7 ','-separated values"])
    # the bounded twin: every window of every valid reading; reconciliation explains every difference
    twin = harness.bounded()
    everything = [r for b in batches for r in map(valid_reading, b) if r]
    unique = {r["id"]: r for r in everything}.values()
    windows = defaultdict(int)
    for r in unique:
        last = r["ms"] - r["ms"] % 60_000
        for start in range(last, r["ms"] - 600_000, -60_000):
            windows[(r["device"], start)] += 1
    assert {(r.device_id, int(r.window_start.timestamp() * 1000)): r.readings for r in twin.main.itertuples()} == windows
    assert harness.reconcile().unexplained == 0


def test_sensors_project_alerts_stream_and_twin_against_the_oracle(spark, tmp_path):
    job = load(str(SENSORS)).jobs["overheat_alerts"]
    batches = _sensor_batches(tmp_path)
    harness = JobHarness(job, tmp_path)
    out = harness.stream(batches)
    # the stream: readings behind the watermark when they arrive are late, the rest are processed in order
    seen, on_time, w, late_ids = set(), [], -(2**62), []
    for batch in batches:
        events = [r for r in map(valid_reading, batch) if r and r["id"] not in seen]
        events = list({r["id"]: r for r in events}.values())
        seen.update(r["id"] for r in events)
        for r in events:
            if r["ms"] <= w:
                late_ids.append(r["id"])
            else:
                on_time.append(r)
        if events:
            w = max(w, max(r["ms"] for r in events) - 30_000)
    streamed = sorted((r.device_id, int(r.alert_at.timestamp() * 1000)) for r in out.main.itertuples())
    assert streamed == overheat_oracle(on_time, until_ms=w)
    assert sorted(out.late["reading_id"]) == sorted(late_ids)
    everything = list({r["id"]: r for b in batches for r in map(valid_reading, b) if r}.values())
    twin = harness.bounded()
    expected = overheat_oracle(everything)
    assert sorted((r.device_id, int(r.alert_at.timestamp() * 1000)) for r in twin.main.itertuples()) == expected
    assert [d for d, _ in expected] == ["dev-000"]  # the 7-minute spell alerts, the 3-minute one does not


# ---- a Parquet source ----------------------------------------------------------------------------------

ORDERS = Source(name="orders", format="parquet", event_time="placed_at", dedup_key="order_id", fields=(
    Field("order_id", "string"), Field("placed_at", "timestamp"), Field("customer", "string", pattern=r"^c[0-9]+$"),
    Field("total", "decimal(10,2)"), Field("items", "int"), Field("express", "boolean", required=False)))
ORDER_TOTALS = WindowedJob(name="order_totals", sources=(ORDERS,), keys=("customer",),
                           window=Tumbling(timedelta(minutes=5)), watermark=Watermark(timedelta(seconds=10)),
                           transform=lambda f: f.select("customer", "placed_at", "order_id", "total", "items"),
                           aggregates=(Agg.count("orders"), Agg.sum("total"), Agg.sum("items")),
                           sink=Table("lake.test.order_totals"))
T0 = datetime(2026, 11, 20, 9, 0, tzinfo=timezone.utc)


def _orders(first: int, count: int, minute: int) -> pd.DataFrame:
    return pd.DataFrame({
        "order_id": [f"o{i}" for i in range(first, first + count)],
        "placed_at": [T0 + timedelta(minutes=minute, seconds=7 * k) for k in range(count)],
        "customer": [f"c{i % 3}" for i in range(first, first + count)],
        "total": [Decimal(f"{10 + i}.{i % 100:02d}") for i in range(first, first + count)],
        "items": pd.array([1 + i % 4 for i in range(first, first + count)], dtype="int32"),
        "express": [i % 2 == 0 for i in range(first, first + count)],
    })


def test_a_parquet_source_streams_and_backfills_against_the_oracle_and_quarantines_bad_files(spark, tmp_path):
    harness = JobHarness(ORDER_TOTALS, tmp_path)
    good = [_orders(0, 20, 0), _orders(20, 20, 4), _orders(40, 20, 9), _orders(60, 20, 16)]
    as_text = _orders(100, 3, 14).astype({"total": str, "items": str})  # other file types: values checked as text
    as_text.loc[1, "total"] = "abc"
    as_text.loc[2, "items"] = "2.5"
    no_customer = _orders(200, 2, 15).drop(columns=["customer"])
    nullable = _orders(300, 2, 15)
    nullable["express"] = None
    harness.write(good[0])
    harness.write(good[1])
    corrupt = Path(harness.settings.landing_dir(ORDERS)) / "garbage.parquet"
    corrupt.write_bytes(b"PAR1 this is not a parquet file")
    os.utime(corrupt, (harness._mtime + 0.5, harness._mtime + 0.5))
    out = harness.stream([good[2], as_text, no_customer, nullable, good[3]])  # in event-time order: none late
    reasons = sorted(out.quarantine["reason"])
    assert reasons[:2] == ["invalid items (expected int): 2.5", "invalid total (expected decimal(10,2)): abc"], reasons
    assert reasons[2:4] == ["missing field customer"] * 2
    assert reasons[4].startswith("unreadable Parquet file:") and len(reasons) == 5
    valid = pd.concat([*good, as_text.iloc[[0]].astype({"total": object, "items": "int32"}), nullable])
    valid["total"] = valid["total"].map(Decimal)
    valid["ws"] = valid["placed_at"].map(lambda t: t.replace(minute=t.minute - t.minute % 5, second=0))
    expected = valid.groupby(["customer", "ws"]).agg(orders=("order_id", "count"), total=("total", "sum"),
                                                     items=("items", "sum")).reset_index()
    twin = harness.bounded()
    got = {(r.customer, r.window_start.to_pydatetime().replace(tzinfo=timezone.utc)): (r.orders, r.total, r.items)
           for r in twin.main.itertuples()}
    assert got == {(r.customer, r.ws.to_pydatetime()): (r.orders, r.total, r.items) for r in expected.itertuples()}
    # the stream: the windows that closed, equal to the twin's (nothing was late here)
    closed = {(r.customer, r.window_start.to_pydatetime().replace(tzinfo=timezone.utc)): (r.orders, r.total, r.items)
              for r in out.main.itertuples()}
    w = out.watermarks[-1]
    assert closed == {k: v for k, v in got.items() if k[1] + timedelta(minutes=5) <= w} and closed
    assert out.late.empty and harness.reconcile().unexplained == 0


# ---- the whole project through Dagster and the CLI ------------------------------------------------------

def test_dagster_picks_up_the_sensors_project_streams_it_and_backfills_a_day(spark, tmp_path):
    import dagster as dg
    import yaml

    from orchestration.definitions import build_definitions
    from streaming.settings import Settings
    from tests.conftest import _WAREHOUSE

    home = tmp_path / "lake"
    home.mkdir()
    (home / "lakestream.yaml").write_text(yaml.safe_dump({
        "project": str(SENSORS), "warehouse": str(_WAREHOUSE[0]), "spark": {"shuffle_partitions": 2},
        "jobs": {"device_temperature": {"max_files_per_trigger": 5}}}))
    settings = Settings.load({"LAKESTREAM_HOME": str(home)})
    JobHarness(load(str(SENSORS)).jobs["device_temperature"], tmp_path / "h")  # drops the job's tables
    sys.path.insert(0, str(SENSORS.parent))
    importlib.import_module("sensors.generate").generate(settings.landing, minutes=12, devices=3)
    defs = build_definitions(settings, home=str(home))
    keys = {k.to_user_string() for a in defs.assets if isinstance(a, (dg.AssetsDefinition, dg.AssetSpec))
            for k in (a.keys if isinstance(a, dg.AssetsDefinition) else [a.key])}
    assert {"lake/sensors/device_temperature", "lake/sensors/overheat_alerts", "streams/device_temperature",
            "landing/sensor_readings", "lake/quarantine/sensor_readings"} <= keys
    assert not any(k.startswith("lake/marts") or "payments" in k for k in keys)  # nothing of the built-in example
    # a job on a job: site_alerts' lineage starts at the table overheat_alerts writes, not at a landing folder
    graph = defs.resolve_asset_graph()
    assert dg.AssetKey(["lake", "sensors", "overheat_alerts"]) in graph.get(dg.AssetKey(["streams", "site_alerts"])).parent_keys
    assert "landing/overheat_alerts" not in keys
    main = dg.AssetKey(["lake", "sensors", "device_temperature"])
    with dg.instance_for_test() as instance:
        streamed = defs.resolve_job_def("device_temperature_stream").execute_in_process(
            instance=instance, run_config={"ops": {"device_temperature": {"config": {"mode": "available_now",
                                                                                    "materialize_every_seconds": 0}}}})
        assert streamed.success
        assert instance.fetch_materializations(main, limit=1).records
        bounded = [a for a in defs.assets if isinstance(a, dg.AssetsDefinition) and main in a.keys]
        result = dg.materialize(bounded, instance=instance, partition_key="2026-11-20", resources=defs.resources,
                                run_config={"ops": {"device_temperature_bounded": {"config": {"force": True}}}})
        assert result.success
        checks = [e for e in result.get_asset_check_evaluations() if e.check_name == "reconciliation"]
        assert checks and checks[0].passed, checks


@pytest.mark.slow
def test_lakestream_new_makes_a_project_whose_test_passes_and_which_the_cli_runs(tmp_path):
    """From nothing: `lakestream new`, the project's own test, then generate, run, backfill, reconcile
    and savepoint on its job through the CLI, pointed at it by its settings file only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAKESTREAM_")}

    def cli(*args, cwd):
        done = subprocess.run([sys.executable, "-m", "lakestream.cli", *args], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-3000:])
        return done.stdout

    said = cli("new", "shop_events", cwd=tmp_path)
    project = tmp_path / "shop_events"
    assert "python -m pytest tests" in said and (project / "tests" / "test_events_per_user.py").exists()
    readme = (project / "README.md").read_text()
    assert "lakestream --config lakestream.yaml generate" in readme and "python -m pytest tests" in readme
    tested = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=project,
                            env=env, capture_output=True, text=True, timeout=900)
    assert tested.returncode == 0 and "1 passed" in tested.stdout, tested.stdout[-3000:] + tested.stderr[-2000:]
    assert "warning" not in tested.stdout.strip().splitlines()[-1], tested.stdout[-3000:]  # (a clean run: no noise)
    config = ["--config", "lakestream.yaml"]
    assert "10 file(s)" in cli(*config, "generate", cwd=project)
    ran = cli(*config, "run", "events_per_user", "--available-now", cwd=project)
    assert "120 events" in ran and "1 quarantined" in ran and "lake.shop_events.events_per_user" in ran
    assert "replaced" in cli(*config, "backfill", "events_per_user", "--start", "2026-11-20", "--end", "2026-11-21",
                             "--force", cwd=project)
    assert "every difference explained" in cli(*config, "reconcile", "events_per_user", "--start", "2026-11-20",
                                               "--end", "2026-11-21", cwd=project)
    assert "savepoint events_per_user-" in cli(*config, "savepoint", "create", "events_per_user", cwd=project)
    # the oracle of the run: the sample files' lines, counted in plain Python
    lines = [line for f in sorted((project / ".lake" / "landing" / "events").glob("*.csv"))
             for line in f.read_text().splitlines()[1:]]
    assert len(lines) == 121 and sum("yesterday" in line for line in lines) == 1


# ---- a table source: another job's output as a stream (silver -> gold) --------------------------------

SILVER = Source(name="silver_orders", format="table", location="lake.test.silver_orders", event_time="placed_at",
                dedup_key="order_key", dedup_from=("customer", "order_no"), fields=(
                    Field("order_key", "string"), Field("order_no", "int"), Field("placed_at", "timestamp"),
                    Field("customer", "string", pattern=r"^c[0-9]+$"), Field("total", "decimal(10,2)")))
GOLD = WindowedJob(name="gold_totals", sources=(SILVER,), keys=("customer",), window=Tumbling(timedelta(minutes=5)),
                   watermark=Watermark(timedelta(seconds=30)),
                   transform=lambda f: f.select("customer", "placed_at", "order_key", "total"),
                   aggregates=(Agg.count("orders"), Agg.sum("total")), sink=Table("lake.test.gold_totals"))


def _silver(first: int, count: int, minute: int, customers: int = 3) -> list[dict]:
    return [{"order_no": i // customers, "customer": f"c{i % customers}", "total": f"{10 + i % 50}.{i % 100:02d}",
             "placed_at": T0 + timedelta(minutes=minute, seconds=11 * k)} for k, i in enumerate(range(first, first + count))]


def _windows(rows: list[dict], closed_before: datetime | None = None) -> dict:
    """Plain-Python tumbling 5-minute totals per customer (the oracle)."""
    out = defaultdict(lambda: [0, Decimal("0")])
    for r in rows:
        t = r["placed_at"]
        start = t.replace(minute=t.minute - t.minute % 5, second=0, microsecond=0)
        if closed_before is None or start + timedelta(minutes=5) <= closed_before:
            out[(r["customer"], start)][0] += 1
            out[(r["customer"], start)][1] += Decimal(r["total"])
    return {k: tuple(v) for k, v in out.items()}


def _got(frame: pd.DataFrame) -> dict:
    return {(r.customer, r.window_start.to_pydatetime().replace(tzinfo=timezone.utc)): (r.orders, r.total)
            for r in frame.itertuples()}


def test_a_table_source_streams_its_appends_and_its_twin_reads_a_snapshot(spark, tmp_path):
    harness = JobHarness(GOLD, tmp_path)
    # the upstream table, created with a looser type for `customer` and `order_no` than declared (strings)
    spark.sql("CREATE TABLE lake.test.silver_orders (order_no string, placed_at timestamp, customer string, "
              "total decimal(10,2)) USING iceberg")
    b1, b2, b3 = _silver(0, 30, 0), _silver(30, 30, 6), _silver(60, 30, 12)
    late = _silver(90, 4, 1)  # minute 1, arriving after the watermark passed 09:05: late for its window
    bad = [{"order_no": "x", "customer": "c1", "total": "1.00", "placed_at": T0 + timedelta(minutes=13)},
           {"order_no": "7", "customer": "zz", "total": "2.00", "placed_at": T0 + timedelta(minutes=13)},
           {"order_no": "8", "customer": "c2", "total": "3.00", "placed_at": None}]
    again = b2[:3]  # the same orders appended a second time: duplicates by (customer, order_no)
    out = harness.stream([b1, b2, b3 + bad, late + again])
    assert sorted(out.quarantine["reason"]) == [
        "invalid customer (expected string matching ^c[0-9]+$): zz", "invalid order_no (expected int): x",
        "missing field placed_at"]
    assert all(f.endswith(".parquet") for f in out.quarantine["source_file"])  # the upstream data file
    w = out.watermarks[-1]
    assert w == b3[-1]["placed_at"] - timedelta(seconds=30)  # the bad row at 13:00 is not an event
    on_time = b1 + b2 + b3
    assert _got(out.main) == _windows(on_time, closed_before=w) and len(out.main) > 6
    assert sorted(out.late["order_key"]) == sorted(f"{r['customer']}|{r['order_no']}" for r in late)
    assert out.batches[-1].duplicates == 3
    # the twin over the table as it is: every valid order once, nothing late
    assert _got(harness.bounded().main) == _windows(on_time + late)
    # rows appended after the stream's last batch are not differences: reconciliation reads the table as of
    # the stream's snapshot (this append reopens a closed window: compared against the current table, the
    # window would differ and nothing would explain it)
    harness.append(SILVER, _silver(200, 2, 6))
    report = harness.reconcile()
    assert report.unexplained == 0 and sum(d.late for d in report.days) > 0, report.table()
    assert _got(harness.bounded().main) == _windows(on_time + late + _silver(200, 2, 6))


def test_sensors_chain_alerts_feed_the_hourly_site_job_as_a_stream_and_a_twin(spark, tmp_path):
    """bronze (CSV readings) -> silver (overheat_alerts, keyed) -> gold (site_alerts, windowed on its table)."""
    project = load(str(SENSORS))
    silver = JobHarness(project.jobs["overheat_alerts"], tmp_path / "silver")
    batches = _sensor_batches(tmp_path)

    def spell(devices, hour, site, tag):  # 9 hot minutes: an alert at hh:05 per device
        return [f"r-{tag}{d}{m:02d},dev-00{d},{site},2026-11-20T{hour}:{m:02d}:00Z,{95 + m % 3}.0,40.00,true"
                for d in devices for m in range(9)]

    def cool(devices, hour, tag):
        return [f"r-{tag}{d},dev-00{d},north,2026-11-20T{hour}:30:00Z,20.0,40.00,true" for d in devices]

    silver.stream(batches + [spell((1, 2), 11, "north", "a"), cool((1, 2), 12, "b"), spell((1,), 13, "south", "c"),
                             cool((1,), 14, "d")])
    alerts = silver.tables().main
    assert len(alerts) == 4 and sorted(alerts["device_id"]) == ["dev-000", "dev-001", "dev-001", "dev-002"], alerts
    gold = JobHarness(project.jobs["site_alerts"], tmp_path / "gold", fresh_inputs=False)
    out = gold.stream([[]])  # the stream reads what the table holds (its snapshots, in commit order)
    # oracle: pandas over the silver table's rows, hourly per site, closed by the gold watermark
    frame = alerts.assign(hour=alerts["alert_at"].dt.floor("h"))
    w = alerts["alert_at"].max() - pd.Timedelta(minutes=10)
    expected = {(r.site, r.hour.to_pydatetime().replace(tzinfo=timezone.utc)): (r.alerts, r.peak, r.hot)
                for r in frame.groupby(["site", "hour"]).agg(alerts=("device_id", "count"), peak=("peak_temperature", "max"),
                                                             hot=("hot_readings", "sum")).reset_index().itertuples()
                if r.hour + pd.Timedelta(hours=1) <= w}
    got = {(r.site, r.window_start.to_pydatetime().replace(tzinfo=timezone.utc)): (r.alerts, r.peak_temperature,
                                                                                  r.hot_readings)
           for r in out.main.itertuples()}
    assert got == expected and got, (got, expected)
    twin = gold.bounded()
    assert len(twin.main) == frame.groupby(["site", "hour"]).ngroups and twin.main["alerts"].sum() == 4
    assert gold.reconcile().unexplained == 0


GOLD_PROJECT = {
    "sources.py": '''
from streaming.declaration import Field, Source
SILVER = Source(name="silver_orders", format="table", location="lake.crash.silver_orders", event_time="placed_at",
                dedup_key="order_key", dedup_from=("customer", "order_no"), fields=(
                    Field("order_key", "string"), Field("order_no", "int"), Field("placed_at", "timestamp"),
                    Field("customer", "string", pattern=r"^c[0-9]+$"), Field("total", "decimal(10,2)")))
''',
    "jobs/gold.py": '''
from datetime import timedelta
from streaming.declaration import Agg, Table, Watermark, WindowedJob
from streaming.windows import Tumbling
from tests.logs import excerpt
from ..sources import SILVER
JOB = WindowedJob(name="crash_gold", sources=(SILVER,), keys=("customer",), window=Tumbling(timedelta(minutes=5)),
                  watermark=Watermark(timedelta(seconds=30)),
                  transform=lambda f: f.select("customer", "placed_at", "order_key", "total"),
                  aggregates=(Agg.count("orders"), Agg.sum("total")), sink=Table("lake.crash.crash_gold"))
''',
}


@pytest.mark.slow
def test_a_table_source_stream_killed_at_every_commit_point_ends_exactly_once(spark, warehouse, tmp_path):
    """SIGKILL the downstream stream at each commit point of its batches (the upstream table grows by
    one snapshot per batch); restarted, its tables equal a plain-Python replay of the snapshots."""
    from tests.test_crash import _kill, _wait_for

    for table in ("crash_gold", "crash_gold_late", "silver_orders"):
        spark.sql(f"DROP TABLE IF EXISTS lake.crash.{table} PURGE")
    spark.sql("DROP TABLE IF EXISTS lake.quarantine.silver_orders PURGE")
    spark.sql("CREATE NAMESPACE IF NOT EXISTS lake.crash")
    spark.sql("CREATE TABLE lake.crash.silver_orders (order_no string, placed_at timestamp, customer string, "
              "total decimal(10,2)) USING iceberg")
    snapshots = [_silver(0, 30, 0), _silver(30, 30, 6) + [{"order_no": "x", "customer": "c1", "total": "1.00",
                                                           "placed_at": T0 + timedelta(minutes=7)}],
                 _silver(60, 30, 12), _silver(90, 4, 1) + _silver(30, 3, 6), _silver(120, 30, 18),
                 _silver(150, 30, 24)]
    for rows in snapshots:
        frame = spark.createDataFrame([(str(r["order_no"]), r["placed_at"], r["customer"], Decimal(r["total"]))
                                       for r in rows], "order_no string, placed_at timestamp, customer string, "
                                                       "total decimal(10,2)")
        frame.coalesce(1).writeTo("lake.crash.silver_orders").append()  # one data file: one batch per snapshot
    root = _project(tmp_path, "crash_project", GOLD_PROJECT)
    home = tmp_path / "home"
    home.mkdir()
    (home / "lakestream.yaml").write_text(f"project: {root}\nwarehouse: {warehouse}\nspark: {{shuffle_partitions: 2}}\n"
                                          # (side tables committed with every batch: their commits are points)
                                          "jobs: {crash_gold: {max_files_per_trigger: 1, side_outputs_every: 0s}}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAKESTREAM_")}
    pauses = tmp_path / "pauses"
    points = ["committed:lake.quarantine.silver_orders", "committed:lake.crash.crash_gold_late",
              "committed:lake.crash.crash_gold", "before-state", "after-state"]
    reached = []
    for point in points:
        child = subprocess.Popen(
            [sys.executable, "-m", "lakestream.cli", "--home", str(home), "run", "crash_gold", "--available-now"],
            env={**env, "LAKESTREAM_PAUSE_AT": point, "LAKESTREAM_PAUSE_DIR": str(pauses),
                 "LAKESTREAM_PAUSE_SECONDS": "120"},
            stdout=open(home / "child.log", "a"), stderr=subprocess.STDOUT, start_new_session=True)
        if _wait_for(lambda: any(p.name.startswith(point + "@") for p in pauses.glob("*")), 120):
            reached.append(point)
        for marker in pauses.glob("*"):
            marker.unlink()
        if child.poll() is None:
            _kill(child)
    final = subprocess.run([sys.executable, "-m", "lakestream.cli", "--home", str(home), "run", "crash_gold",
                            "--available-now"], env=env, capture_output=True, text=True, timeout=600)
    assert final.returncode == 0, final.stdout[-2000:] + final.stderr[-2000:]
    assert len(reached) >= 4, (reached, excerpt(home / "child.log"))
    # the oracle: snapshots in commit order as micro-batches, dedup by (customer, order_no), the watermark rule
    seen, w, closed, late = set(), None, defaultdict(lambda: [0, Decimal("0")]), []
    for rows in snapshots:
        events = []
        for r in rows:
            key = f"{r['customer']}|{r['order_no']}"
            if r["order_no"] != "x" and key not in seen:
                seen.add(key)
                events.append(r)
        for r in events:
            t = r["placed_at"]
            start = t.replace(minute=t.minute - t.minute % 5, second=0, microsecond=0)
            if w is not None and start + timedelta(minutes=5) <= w:
                late.append(f"{r['customer']}|{r['order_no']}")
            else:
                closed[(r["customer"], start)][0] += 1
                closed[(r["customer"], start)][1] += Decimal(r["total"])
        if events:
            w = max(x for x in (w, max(r["placed_at"] for r in events) - timedelta(seconds=30)) if x is not None)
    expected = {k: tuple(v) for k, v in closed.items() if k[1] + timedelta(minutes=5) <= w}
    main = spark.table("lake.crash.crash_gold").toPandas()
    assert len(main) == len(main.drop_duplicates(["customer", "window_start"])), "a window written twice"
    assert _got(main) == expected and len(expected) > 10
    got_late = [r.order_key for r in spark.table("lake.crash.crash_gold_late").collect()]
    assert sorted(got_late) == sorted(late) and late
    assert spark.table("lake.quarantine.silver_orders").count() == 1
