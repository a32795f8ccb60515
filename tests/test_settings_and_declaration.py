"""Settings precedence and validation; declarations validate at construction. No Spark."""

from __future__ import annotations

from datetime import timedelta

import pytest

from streaming.declaration import Agg, Table, Watermark
from streaming.windows import Tumbling
from streaming.errors import ConfigError, DeclarationError
from streaming.project import get_job, registry
from streaming.spark.session import spark_conf
from streaming.settings import Settings


def test_defaults_live_under_one_home(tmp_path):
    s = Settings.load({"LAKESTREAM_HOME": str(tmp_path)})
    assert s.landing == str(tmp_path / "landing")
    assert s.warehouse == str(tmp_path / "warehouse")
    assert s.checkpoint_dir("purchase_metrics") == f"{tmp_path}/checkpoints/purchase_metrics"
    assert s.spark_master == "local[*]"


def test_yaml_then_environment_override_and_reach_spark_conf(tmp_path):
    (tmp_path / "lakestream.yaml").write_text(
        "spark: {master: 'spark://10.0.0.5:7077', shuffle_partitions: 8}\n"
        "iceberg: {catalog: rest, uri: 'http://catalog:8181', warehouse: 's3a://b/wh'}\n"
        "jobs: {purchase_metrics: {out_of_orderness: 10s, max_files_per_trigger: 2}}\n"
    )
    s = Settings.load({"LAKESTREAM_HOME": str(tmp_path), "LAKESTREAM_SPARK_MASTER": "local[2]"})
    conf = spark_conf(s)
    assert conf["spark.master"] == "local[2]"  # environment wins over YAML
    assert conf["spark.sql.shuffle.partitions"] == "8"
    assert conf["spark.sql.catalog.lake.type"] == "rest"
    assert conf["spark.sql.catalog.lake.uri"] == "http://catalog:8181"
    assert conf["spark.sql.catalog.lake.warehouse"] == "s3a://b/wh"
    assert "RocksDBStateStoreProvider" in conf["spark.sql.streaming.stateStore.providerClass"]
    assert "spark.jars.packages" not in conf  # Maven only when configured
    assert conf["spark.jars"].endswith(".jar")
    job = get_job("purchase_metrics", s)
    assert job.watermark.out_of_orderness == timedelta(seconds=10)
    assert s.job("purchase_metrics").max_files_per_trigger == 2


@pytest.mark.parametrize(
    "text, phrase",
    [
        ("sparks: {}\n", "unknown key(s) ['sparks']"),
        ("jobs: {purchase_metrics: {out_of_orderness: soon}}\n", "jobs.purchase_metrics.out_of_orderness"),
        ("spark: [1, 2]\n", "'spark' must be a mapping"),
        ("spark: {shuffle_partitions: 0}\n", "at least 1"),
        ("a: [\n", "not valid YAML"),
        ("iceberg: {snapshot_retention: 0s}\n", "iceberg.snapshot_retention must be positive"),
        ("iceberg: {expire_every: often}\n", "iceberg.expire_every"),
    ],
)
def test_bad_settings_name_the_problem(tmp_path, text, phrase):
    (tmp_path / "lakestream.yaml").write_text(text)
    with pytest.raises(ConfigError, match=None) as info:
        Settings.load({"LAKESTREAM_HOME": str(tmp_path)})
    assert phrase in str(info.value)
    assert "\n" not in str(info.value)


def test_declarations_validate_at_construction():
    with pytest.raises(DeclarationError, match="Tumbling.size must be positive"):
        Tumbling(size=timedelta(0))
    with pytest.raises(DeclarationError, match="allowed_lateness must be a timedelta >= 0"):
        Watermark(out_of_orderness=timedelta(seconds=5), allowed_lateness=timedelta(seconds=-1))
    with pytest.raises(DeclarationError, match="lake.<namespace>.<table>"):
        Table("payments.purchase_metrics")
    with pytest.raises(DeclarationError, match="must be one of sum, min, max, count, avg, count_distinct"):
        Agg("mode", "amount")


def test_the_job_declaration_is_frozen_hashable_and_fingerprinted():
    job = registry()["purchase_metrics"]
    assert hash(job) == hash(registry()["purchase_metrics"])
    with pytest.raises(AttributeError):
        job.keys = ("card_id",)  # type: ignore[misc]
    from dataclasses import replace

    assert replace(job, keys=("card_id",)).fingerprint() != job.fingerprint()
    assert replace(job, window=Tumbling(timedelta(minutes=10))).fingerprint() != job.fingerprint()
    assert replace(job, watermark=Watermark(timedelta(seconds=9))).fingerprint() == job.fingerprint()


def test_window_declarations_validate_and_suggest_the_fix():
    from streaming.windows import Session, Sliding

    with pytest.raises(DeclarationError, match=r"`every` must not exceed `size`.*did you mean Tumbling\(size=5m\)"):
        Sliding(size=timedelta(minutes=5), every=timedelta(minutes=10))
    with pytest.raises(DeclarationError, match="Session.gap must be positive"):
        Session(gap=timedelta(0))
    assert Sliding(timedelta(minutes=10), timedelta(minutes=1)).windows_per_event == 10


def test_a_changed_keyed_state_declaration_is_named_by_the_compatibility_guard():
    from dataclasses import replace

    from streaming.checkpoint.compat import differences
    from streaming.keyed import KeyedProcessFunction, TtlConfig, ValueStateDescriptor

    job = registry()["large_amount_alerts"]

    class WiderState(KeyedProcessFunction):
        def open(self, ctx):
            self.previous = ctx.get_state(ValueStateDescriptor("previous", "double", ttl=TtlConfig(timedelta(hours=48))))

    WiderState.__module__, WiderState.__qualname__ = job.function.__module__, job.function.__qualname__
    changed = replace(job, function=WiderState)
    found = differences(job.shape(), 2, changed, 2)
    assert len(found) == 1 and found[0].startswith("state schema changed from ['value previous: struct<")
    assert "'value previous: double, ttl=2d/OnCreateAndWrite'" in found[0]
    assert differences(job.shape(), 2, replace(job, keys=("user_id",)), 2) == [
        "key columns changed from ['card_id'] to ['user_id']"]


def test_keyed_jobs_refuse_allowed_lateness_and_unknown_time_columns():
    from dataclasses import replace

    job = registry()["suspicious_logins"]
    with pytest.raises(DeclarationError, match="allowed_lateness applies to windows"):
        replace(job, watermark=Watermark(timedelta(seconds=5), allowed_lateness=timedelta(minutes=1)))
    with pytest.raises(DeclarationError, match="time_column 'when' is not an output column"):
        replace(job, time_column="when")


def test_an_override_of_zero_is_honoured_not_replaced_by_the_declared_default(tmp_path):
    (tmp_path / "lakestream.yaml").write_text(
        "jobs: {purchase_metrics: {out_of_orderness: 0s, allowed_lateness: 0s, trigger_interval: 0s},\n"
        "       decline_velocity: {allowed_lateness: 0s}}\n"
    )
    s = Settings.load({"LAKESTREAM_HOME": str(tmp_path)})
    assert get_job("purchase_metrics").watermark.out_of_orderness == timedelta(seconds=5)  # the declaration
    job = get_job("purchase_metrics", s)
    assert job.watermark.out_of_orderness == timedelta(0)
    assert s.job("purchase_metrics").trigger_interval == timedelta(0)
    assert get_job("decline_velocity", s).watermark.allowed_lateness == timedelta(0)


@pytest.mark.parametrize(
    "text, phrase",
    [
        ("jobs: {purchase_metrics: {dedup_ttl: 0s}}\n", "jobs.purchase_metrics.dedup_ttl must be positive"),
        ("jobs: {purchase_metrics: {max_files_per_trigger: 0}}\n", "max_files_per_trigger must be a whole number of at least 1"),
        ("jobs: {purchase_metrics: {max_files_per_trigger: many}}\n", "max_files_per_trigger must be a whole number"),
    ],
)
def test_a_zero_that_cannot_work_is_refused_with_the_key_named(tmp_path, text, phrase):
    (tmp_path / "lakestream.yaml").write_text(text)
    with pytest.raises(ConfigError) as info:
        Settings.load({"LAKESTREAM_HOME": str(tmp_path)})
    assert phrase in str(info.value)


def test_late_counts_and_reconciliation_say_what_they_count():
    """"Late" counts rows of the late side output: an event for keyed, tumbling and session jobs, an event and
    one window it missed for sliding ones. Reconciliation counts windows (or a keyed job's output rows)."""
    from datetime import datetime, timezone

    from batch.reconcile import ReconcileReport
    from streaming.declaration import late_count
    from streaming.project import get_job

    assert late_count(get_job("purchase_metrics"), 3) == "3 late events"
    assert late_count(get_job("user_sessions"), 1) == "1 late event"
    assert late_count(get_job("large_amount_alerts"), 1_200) == "1,200 late events"
    assert late_count(get_job("decline_velocity"), 20) == "20 late rows (an event once per window it missed)"
    at = datetime(2026, 1, 1, tzinfo=timezone.utc)
    assert ReconcileReport("purchase_metrics", at, at, 0).table().startswith("counted in windows (keys + window start)")
    assert ReconcileReport("large_amount_alerts", at, at, 0, unit="rows").table().startswith("counted in output rows")


def test_the_savepoint_schedule_is_a_setting_and_a_bad_cron_is_refused_in_one_line(tmp_path):
    from streaming.errors import ConfigError
    from streaming.settings import Settings

    path = tmp_path / "lakestream.yaml"
    assert Settings.load(environ={}, config_file=path if path.exists() else None).savepoint_schedule == "0 4 * * *"
    path.write_text("savepoint_schedule: '30 3 * * 1-5'\n")
    assert Settings.load(environ={}, config_file=path).savepoint_schedule == "30 3 * * 1-5"
    path.write_text("savepoint_schedule: 'every day at 4'\n")
    with pytest.raises(ConfigError) as refused:
        Settings.load(environ={}, config_file=path)
    assert "\n" not in str(refused.value) and "five fields" in str(refused.value) and "'0 4 * * *'" in str(refused.value)


def test_a_local_master_uses_the_throughput_collector_unless_the_options_name_a_gc(tmp_path):
    from dataclasses import replace

    from streaming.spark.session import spark_conf

    settings = Settings.load({"LAKESTREAM_HOME": str(tmp_path), "LAKESTREAM_CLASS_ARCHIVE": "0"})
    assert "-XX:+UseParallelGC" in spark_conf(settings)["spark.driver.extraJavaOptions"]
    mine = replace(settings, jvm_options="-XX:+UseG1GC")
    options = spark_conf(mine)["spark.driver.extraJavaOptions"]
    assert "UseParallelGC" not in options and "-XX:+UseG1GC" in options
    cluster = replace(settings, spark_master="spark://somewhere:7077")
    assert "UseParallelGC" not in spark_conf(cluster)["spark.driver.extraJavaOptions"]


def test_a_local_master_starts_with_its_whole_heap_unless_the_options_size_it(tmp_path):
    from dataclasses import replace

    from streaming.spark.session import spark_conf

    settings = Settings.load({"LAKESTREAM_HOME": str(tmp_path), "LAKESTREAM_CLASS_ARCHIVE": "0"})
    options = spark_conf(settings)["spark.driver.extraJavaOptions"].split()
    assert "-Xms4096m" in options and "-XX:MetaspaceSize=256m" in options  # (the default driver memory: 4g)
    bigger = replace(settings, spark_conf={"spark.driver.memory": "6gb"})
    assert "-Xms6144m" in spark_conf(bigger)["spark.driver.extraJavaOptions"].split()
    bare = replace(settings, spark_conf={"spark.driver.memory": "2048"})  # (Spark reads a bare number as MiB)
    assert "-Xms2048m" in spark_conf(bare)["spark.driver.extraJavaOptions"].split()
    mine = replace(settings, jvm_options="-Xms1g -XX:MetaspaceSize=128m")
    options = spark_conf(mine)["spark.driver.extraJavaOptions"].split()
    assert [o for o in options if o.startswith("-Xms")] == ["-Xms1g"]
    assert [o for o in options if "MetaspaceSize" in o] == ["-XX:MetaspaceSize=128m"]
    cluster = replace(settings, spark_master="spark://somewhere:7077")
    assert "-Xms" not in spark_conf(cluster)["spark.driver.extraJavaOptions"]
