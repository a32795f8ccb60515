"""One SparkSession for the whole test session; a lake home per test (tables dropped between tests)."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest

from lakestream.generator import GeneratorConfig, generate
from streaming.settings import Settings


@pytest.fixture(scope="session")
def warehouse(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("warehouse")
    _WAREHOUSE[:] = [path]
    return path


@pytest.fixture(scope="session")
def spark(warehouse):
    from streaming.spark.session import get_spark, stop_spark

    settings = Settings.load({"LAKESTREAM_HOME": str(warehouse.parent / "session-home")})
    settings = _with_warehouse(settings, warehouse)
    session = get_spark(settings, record_classes=False)  # (maps the class archive; CLI processes record it)
    yield session
    stop_spark()


def _with_warehouse(settings: Settings, warehouse: Path) -> Settings:
    from dataclasses import replace

    return replace(settings, warehouse=str(warehouse), shuffle_partitions=2)


_WAREHOUSE: list[Path] = []


NAMESPACES = ("payments", "quarantine", "fraud", "logins", "ops", "test")


def drop_job_tables(spark, namespaces: tuple[str, ...] = NAMESPACES) -> None:
    """Empty the shared Iceberg warehouse of lakestream tables (of ``namespaces``)."""
    for namespace in namespaces:
        if spark.sql(f"SHOW NAMESPACES IN lake LIKE '{namespace}'").count():
            for row in spark.sql(f"SHOW TABLES IN lake.{namespace}").collect():
                spark.sql(f"DROP TABLE IF EXISTS lake.{namespace}.{row.tableName} PURGE")


def scratch_namespace(spark, name: str):
    """A namespace of the ``lake`` catalog for one test's own tables, emptied after it (a generator for a fixture;
    each test file its own name: files run on different workers at once)."""
    namespace = f"lake.{name}"
    spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {namespace}")
    yield namespace
    for row in spark.sql(f"SHOW TABLES IN {namespace}").collect():
        spark.sql(f"DROP TABLE IF EXISTS {namespace}.{row.tableName} PURGE")


def settings_for(home: Path) -> Settings:
    """Settings for a lake home at ``home``, on the session's shared warehouse."""
    return _with_warehouse(Settings.load({"LAKESTREAM_HOME": str(home / "lake")}), _WAREHOUSE[0])


def write_config(settings: Settings, jobs: dict | None = None) -> Settings:
    """Write ``lakestream.yaml`` into the lake home (for code that loads settings itself, e.g. a
    Dagster op) and return the settings it yields."""
    import yaml

    data = {"warehouse": str(_WAREHOUSE[0]), "spark": {"shuffle_partitions": 2}, "jobs": jobs or {}}
    settings.home.mkdir(parents=True, exist_ok=True)
    (settings.home / "lakestream.yaml").write_text(yaml.safe_dump(data))
    return Settings.load({"LAKESTREAM_HOME": str(settings.home)})


@pytest.fixture
def lake(tmp_path, warehouse, spark) -> Settings:
    """Settings for a fresh lake home; the shared Iceberg warehouse is emptied of job tables."""
    drop_job_tables(spark)
    return settings_for(tmp_path)


SMALL = GeneratorConfig(
    seed=7,
    duration=timedelta(minutes=12),
    rate=15.0,
    users=40,
    late_fraction=0.03,
    late_min=timedelta(minutes=1),
    late_max=timedelta(minutes=6),
    duplicate_fraction=0.02,
    malformed_fraction=0.01,
    file_seconds=60,
)


@pytest.fixture
def small_landing(lake) -> Settings:
    """~10k payments over 12 minutes with late, duplicated and malformed lines, ~18 files."""
    generate(SMALL, lake.landing, sources=("payments",))
    return lake


def pytest_configure(config):
    import sys

    os.environ["PYSPARK_PYTHON"] = sys.executable
    # Every JVM of the suite (the session's, and those of the CLIs, Dagster runs and clusters it starts)
    # compiles with C1 only: its runs are short, and a short run spent ~30 % less CPU (40-44 vs 59-65 s
    # for a 27-file stream run), on a machine the suite keeps busy.
    os.environ.setdefault("LAKESTREAM_JVM_OPTIONS", "-XX:TieredStopAtLevel=1")


# The files that take longest, first: two test processes (`make test`) then end together instead of one
# finishing a long file alone (measured 2026-11-26 under two processes, seconds).
_LONGEST_FIRST = ("test_dagster_e2e.py", "test_chaos.py", "test_crash.py", "test_user_project.py", "test_old_layout.py",
                  "test_cluster.py", "test_windows.py", "test_operator_path.py", "test_dagster.py", "test_properties.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: the rest keep their order)
