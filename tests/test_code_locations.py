"""Projects as code locations: `lakestream new` writes a Dagster entry point (definitions.py), and the built-in
example and a user project load side by side, each with its own assets, checks, jobs, sensors and schedules,
its settings from its own lakestream.yaml (no LAKESTREAM_* variable of the other reaches it)."""

from __future__ import annotations

import importlib.util
import sys

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
