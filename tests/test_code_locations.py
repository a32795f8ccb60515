"""Projects as code locations: `lakestream new` writes a Dagster entry point (definitions.py), and the built-in
example and a user project load side by side, each with its own assets, checks, jobs, sensors and schedules,
its settings from its own lakestream.yaml (no LAKESTREAM_* variable of the other reaches it)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from dagster import AssetKey

from lakestream.scaffold import scaffold


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _keys(defs) -> set[str]:
    return {"/".join(k.path) for k in defs.resolve_asset_graph().get_all_asset_keys()}


def test_a_scaffolded_project_and_the_built_in_example_are_two_code_locations(tmp_path, monkeypatch):
    from orchestration.definitions import build_definitions

    scaffold(tmp_path / "shop_events")
    # another location's variables must not leak in: the example project, a lake home elsewhere
    monkeypatch.setenv("LAKESTREAM_PROJECT", "examples/sensors")
    monkeypatch.setenv("LAKESTREAM_HOME", str(tmp_path / "elsewhere"))
    shop = _load(tmp_path / "shop_events" / "definitions.py", "shop_events_definitions").defs
    shop_keys = _keys(shop)
    assert "lake/shop_events/events_per_user" in shop_keys and "streams/events_per_user" in shop_keys
    assert not any("purchase_metrics" in k or "sensor" in k for k in shop_keys), shop_keys
    settings = shop.resources["lakestream"].settings()
    assert settings.home == tmp_path / "shop_events" / ".lake"  # (beside its lakestream.yaml, not LAKESTREAM_HOME)
    assert settings.project == str(tmp_path / "shop_events")
    assert {j.name for j in shop.jobs} >= {"events_per_user_stream", "streams"}
    assert {s.name for s in shop.sensors} and {s.name for s in shop.schedules}

    monkeypatch.delenv("LAKESTREAM_PROJECT")
    example = build_definitions()
    example_keys = _keys(example)
    assert "lake/payments/purchase_metrics" in example_keys and not shop_keys & {k for k in example_keys if k.startswith("lake/")}


def test_lakestream_new_bare_writes_a_skeleton_with_its_own_entry_point(tmp_path):
    files = {p.relative_to(tmp_path / "skel").as_posix() for p in scaffold(tmp_path / "skel", bare=True)}
    assert files == {"__init__.py", "jobs/__init__.py", "tests/__init__.py", "definitions.py", "lakestream.yaml",
                     ".gitignore", "pytest.ini", "sources.py", "jobs/events_per_key.py", "tests/test_events_per_key.py",
                     "README.md"}
    defs = _load(tmp_path / "skel" / "definitions.py", "skel_definitions").defs
    assert "lake/skel/events_per_key" in _keys(defs)


def test_a_windowed_jobs_table_carries_a_freshness_policy_from_its_window_watermark_and_trigger():
    """Dagster's own freshness (its daemon evaluates it): a warning after one window step plus the
    out-of-orderness, the trigger and the merge of materializations (+30 s), a failure after twice that; keyed
    tables (no cadence) carry none."""
    from datetime import timedelta

    from orchestration.definitions import build_definitions

    graph = build_definitions().resolve_asset_graph()
    policy = graph.get(AssetKey(["lake", "payments", "purchase_metrics"])).freshness_policy
    expected = timedelta(minutes=5) + timedelta(seconds=5) + timedelta(seconds=10 + 30)  # 5-min windows, 5 s, trigger 0
    assert policy.warn_window.to_timedelta() == expected and policy.fail_window.to_timedelta() == 2 * expected
    sliding = graph.get(AssetKey(["lake", "fraud", "decline_alerts"])).freshness_policy  # slides every minute
    assert sliding.warn_window.to_timedelta() == timedelta(minutes=1, seconds=5 + 10 + 30)
    assert graph.get(AssetKey(["lake", "payments", "rolling_spend"])).freshness_policy is None


@pytest.mark.slow
def test_one_webserver_serves_the_example_and_a_user_project_as_two_code_locations(tmp_path):
    """A real dagster-webserver over a workspace of two locations: each loads, with its own assets, jobs,
    sensors and schedules (asked over GraphQL, as the UI does)."""
    import json
    import os
    import signal
    import socket
    import subprocess
    import time
    import urllib.request
    from pathlib import Path

    from orchestration.record import ensure_dagster_yaml

    repo = Path(__file__).resolve().parents[1]
    scaffold(tmp_path / "shop_events")
    home = tmp_path / "dagster"
    ensure_dagster_yaml(str(home))
    (tmp_path / "workspace.yaml").write_text(
        "load_from:\n"
        f"  - python_module:\n      module_name: orchestration.definitions\n      location_name: example\n"
        f"      working_directory: {repo}\n"
        f"  - python_file:\n      relative_path: {tmp_path / 'shop_events' / 'definitions.py'}\n"
        f"      location_name: shop_events\n      working_directory: {tmp_path}\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAKESTREAM_")}
    env.update(DAGSTER_HOME=str(home), LAKESTREAM_HOME=str(tmp_path / "example-lake"))
    log = open(tmp_path / "webserver.log", "w")
    server = subprocess.Popen([str(Path(sys.executable).parent / "dagster-webserver"), "-h", "127.0.0.1", "-p",
                               str(port), "-w", str(tmp_path / "workspace.yaml")], cwd=tmp_path, env=env,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    query = ("{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus locationOrLoadError { "
             "__typename ... on PythonError { message } ... on RepositoryLocation { repositories { "
             "assetNodes { assetKey { path } } jobs { name } sensors { name } schedules { name } } } } } } } }")
    try:
        deadline, entries = time.monotonic() + 240, []
        while time.monotonic() < deadline:
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", data=json.dumps(
                    {"query": query}).encode(), headers={"Content-Type": "application/json"})
                entries = json.loads(urllib.request.urlopen(request, timeout=60).read())["data"][
                    "workspaceOrError"]["locationEntries"]
                if len(entries) == 2 and all(e["loadStatus"] == "LOADED" for e in entries):
                    break
            except (OSError, KeyError, TypeError):
                pass
            time.sleep(1)
        located = {e["name"]: e["locationOrLoadError"] for e in entries}
        assert set(located) == {"example", "shop_events"}, (entries, (tmp_path / "webserver.log").read_text()[-3000:])
        assert all(v["__typename"] == "RepositoryLocation" for v in located.values()), located
        seen = {}
        for name, location in located.items():
            repo_ = location["repositories"][0]
            seen[name] = ({"/".join(n["assetKey"]["path"]) for n in repo_["assetNodes"]}, {j["name"] for j in repo_["jobs"]},
                          {s["name"] for s in repo_["sensors"]}, {s["name"] for s in repo_["schedules"]})
        example_assets, example_jobs, example_sensors, example_schedules = seen["example"]
        shop_assets, shop_jobs, shop_sensors, shop_schedules = seen["shop_events"]
        assert "lake/payments/purchase_metrics" in example_assets and "purchase_metrics_stream" in example_jobs
        assert "lake/shop_events/events_per_user" in shop_assets and "events_per_user_stream" in shop_jobs
        assert not any("purchase_metrics" in a for a in shop_assets) and not any("shop_events" in a for a in example_assets)
        assert shop_sensors and example_sensors and shop_schedules and example_schedules
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
