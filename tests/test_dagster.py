"""Dagster definitions, in process: lineage, stream runs, partitioned bounded twins, dbt marts,
sensors over real checkpoints (healthy, stalled, corrupt), the supervisor and the schedules.

Real instance (``instance_for_test``), real Spark and Iceberg tables, real checkpoints.
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import dagster as dg
import pytest

from orchestration.definitions import build_definitions
from orchestration.sensors import supervise
from orchestration.streams import DesiredState
from tests import oracle
from tests.conftest import SMALL, write_config

MAIN = dg.AssetKey(["lake", "payments", "purchase_metrics"])
STREAM = dg.AssetKey(["streams", "purchase_metrics"])  # the checks about the stream live here
DAY = SMALL.start.strftime("%Y-%m-%d")


def defs_for(settings):
    return build_definitions(settings, home=str(settings.home))


def stream_config(mode="available_now", **extra):
    return {"ops": {"purchase_metrics": {"config": {"mode": mode, "materialize_every_seconds": 0, **extra}}}}


def latest_check(instance, key: dg.AssetKey, name: str, partition: str | None = None):
    storage = instance.event_log_storage
    filt = None
    if partition is not None:
        from dagster._core.event_api import PartitionKeyFilter

        filt = PartitionKeyFilter(key=partition)
    records = storage.get_asset_check_execution_history(dg.AssetCheckKey(key, name), limit=1, partition_filter=filt)
    return records[0] if records else None


def evaluation_of(record):
    return record.event.dagster_event.event_specific_data


def test_definitions_load_with_lineage_from_landing_through_jobs_to_the_marts(lake):
    defs = defs_for(lake)
    dg.Definitions.validate_loadable(defs)
    graph = defs.resolve_asset_graph()
    mart = dg.AssetKey(["lake", "marts", "user_daily_activity"])
    assert dg.AssetKey(["landing", "payments"]) in graph.get(MAIN).parent_keys
    assert MAIN in graph.get(mart).parent_keys
    assert graph.get(MAIN).partitions_def is not None
    for job in ("purchase_metrics_stream", "user_sessions_stream", "savepoint_before_deploy", "daily_backfill"):
        assert defs.resolve_job_def(job) is not None
    checks = {k.name for k in graph.asset_check_keys if k.asset_key == MAIN}
    assert checks == {"reconciliation"}  # per day, evaluated by each materialization of the day
    # the stream is an asset of its own between the landing zone and its tables, with the checks about it
    # (unpartitioned checks on the day-partitioned table stayed "In Progress" after every partitioned run)
    assert {k.name for k in graph.asset_check_keys if k.asset_key == STREAM} == {
        "checkpoint_health", "freshness", "stream_supervisor", "late_volume"}
    assert dg.AssetKey(["landing", "payments"]) in graph.get(STREAM).parent_keys and STREAM in graph.get(MAIN).parent_keys
    assert any(k.asset_key == mart for k in graph.asset_check_keys), "dbt tests are asset checks"


def test_the_landing_zone_is_observed_as_files_bytes_and_what_the_slowest_reader_has_not_read(small_landing):
    from dagster._core.definitions.observe import observe  # the in-process form of the UI's "Observe sources"

    defs = defs_for(small_landing)
    landing = defs.resolve_assets_def(dg.AssetKey(["landing", "payments"]))
    folder = Path(small_landing.landing_dir("payments"))
    files = [p for p in folder.iterdir() if p.is_file() and not p.name.startswith((".", "_"))]
    with dg.instance_for_test() as instance:
        result = observe([landing], instance=instance)  # resources come bound from the definitions
        assert result.success
        seen = {e.asset_key: e.event_specific_data.asset_observation.metadata for e in result.all_events
                if e.event_type_value == "ASSET_OBSERVATION"}
    meta = seen[dg.AssetKey(["landing", "payments"])]
    assert meta["files"].value == len(files) > 0
    assert meta["bytes"].value == sum(p.stat().st_size for p in files)
    assert meta["pending_files"].value == len(files)  # no stream has read anything yet
    assert meta["slowest_reader"].value in {j for j in ("purchase_metrics", "decline_velocity", "large_amount_alerts",
                                                        "rolling_spend", "user_sessions")}
    assert seen[dg.AssetKey(["landing", "logins"])]["files"].value == 0


def test_a_stream_run_records_a_materialization_per_batch_and_partition(spark, small_landing):
    settings = write_config(small_landing, {"purchase_metrics": {"max_files_per_trigger": 6}})
    defs = defs_for(settings)
    with dg.instance_for_test() as instance:
        job = defs.resolve_job_def("purchase_metrics_stream")
        result = job.execute_in_process(instance=instance, run_config=stream_config())
        assert result.success
        events = [e.event_specific_data.materialization for e in result.all_events
                  if e.event_type_value == "ASSET_MATERIALIZATION"]
        main = [m for m in events if m.asset_key == MAIN]
        observed = [e.event_specific_data.asset_observation for e in result.all_events
                    if e.event_type_value == "ASSET_OBSERVATION"]
        logs = [r.user_message for r in instance.all_logs(result.run_id)]
        warned = [r.user_message for r in instance.all_logs(result.run_id) if r.level >= 30]
        checked = [e.event_specific_data for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"
                   and e.event_specific_data.check_name == "quarantine_volume"]
        again = job.execute_in_process(instance=instance, run_config=stream_config())  # nothing new to read
        summary = [r.user_message for r in instance.all_logs(again.run_id) if "batch(es)" in r.user_message]
    files = oracle.files_in_arrival_order(Path(settings.landing_dir("payments")))
    truth = oracle.replay_stream([[line for p in files[i:i + 6] for line in oracle.read_lines(p)]
                                  for i in range(0, len(files), 6)])
    assert spark.table("lake.payments.purchase_metrics").count() == len(truth.closed) > 0
    assert len(main) >= 2 and {m.partition for m in main} == {DAY}  # one per batch that wrote the day
    meta = main[-1].metadata
    watermarks = [m.metadata["watermark_time"].value for m in events if "watermark_time" in m.metadata]
    assert round(max(watermarks) * 1000) == truth.watermark_ms  # the last batch's, as a timestamp Dagster shows as one
    assert all(isinstance(m.metadata["batch_seconds"].value, float) and
               m.metadata["batch_seconds"].value == round(m.metadata["batch_seconds"].value, 2) for m in main)
    assert max(m.metadata["state_rows"].value for m in main) > 0  # the windowed job's store, not Spark's (none)
    # the stream's own asset gets an unpartitioned observation per flush: its figures plot over time
    assert len(observed) >= 2 and all(o.asset_key == STREAM for o in observed)
    assert [o.metadata["last_batch"].value for o in observed] == sorted(o.metadata["last_batch"].value for o in observed)
    # an empty run reports the watermark its checkpoint holds, not "-inf"
    assert summary and "0 batch(es)" in summary[0] and "-inf" not in summary[0] and DAY in summary[0], summary
    day_end_ms = (datetime.fromisoformat(DAY).replace(tzinfo=timezone.utc) + timedelta(days=1)).timestamp() * 1000
    assert main[-1].metadata["day_complete"].value == (truth.watermark_ms >= day_end_ms)
    batches = [line for line in logs if line.startswith("purchase_metrics batch ") and "quarantined:" not in line]
    assert len(batches) >= len(files) // 6 and all("lines" in b and "watermark" in b for b in batches)
    assert {m.asset_key.path[-1] for m in events} >= {"purchase_metrics", "purchase_metrics_late", "payments"}
    assert {"rows_in", "rows_written", "batch_seconds", "watermark_lag_s", "state_rows", "table_version",
            "processed_rows_per_s"} <= set(meta)
    assert sum(m.metadata["rows_written"].value for m in main) == len(truth.closed)
    # a quarantine table's events say how many lines, from which files and why (no stream figures), and each
    # batch that quarantined lines says so as a warning naming the file and the reason
    bad = {(p.name, line) for p in files for line in oracle.read_lines(p) if oracle.validate(line) is None}
    quarantine = [m for m in events if m.asset_key.path[-1] == "payments"]
    assert sum(q.metadata["rows_written"].value for q in quarantine) == len(bad) > 0  # (a row per file and line)
    assert all(not {"state_rows", "day_complete", "watermark_lag_s"} & set(q.metadata) for q in quarantine)
    assert any(".jsonl: " in q.metadata["examples"].value for q in quarantine)
    assert any("quarantined: " in w and ".jsonl: " in w and ("malformed" in w or "invalid" in w or "missing" in w)
               for w in warned), warned
    # and the quarantine check is evaluated on those batches: their lines and quarantined lines, as counted here
    assert checked and sum(c.metadata["quarantined"].value for c in checked) == sum(
        1 for p in files for line in oracle.read_lines(p) if oracle.validate(line) is None)
    assert all(c.passed == (c.metadata["share_pct"].value <= 2.0) and "quarantined (" in c.description for c in checked)


def test_the_streams_job_runs_several_jobs_in_one_application_and_is_supervised_as_a_whole(spark, small_landing):
    from tests import oracle_jobs as oj

    names = ["purchase_metrics", "large_amount_alerts"]
    settings = write_config(small_landing, {n: {"max_files_per_trigger": 6} for n in names})
    defs = defs_for(settings)
    config = {"ops": {"run_streams": {"config": {"jobs": names, "materialize_every_seconds": 0}}}}
    with dg.instance_for_test() as instance:
        result = defs.resolve_job_def("streams").execute_in_process(instance=instance, run_config=config)
        assert result.success
        touched = {e.event_specific_data.materialization.asset_key for e in result.all_events
                   if e.event_type_value == "ASSET_MATERIALIZATION"}
        assert {MAIN, dg.AssetKey(["lake", "fraud", "large_amount_alerts"])} <= touched

        # a continuous application that ended (rolled over, say) restarts as a whole: one request
        for n in names:
            DesiredState(instance, n).set("running", trigger_interval_seconds=1, application=names, run_id=result.run_id)
        sensor = defs.resolve_sensor_def("stream_supervisor")
        requests = sensor(dg.build_sensor_context(instance=instance, definitions=defs, resources=defs.resources))
        assert len(requests) == 1 and requests[0].job_name == "streams", requests
        restart = requests[0].run_config["ops"]["run_streams"]["config"]
        assert restart["jobs"] == names and restart["mode"] == "continuous"

        bad = defs.resolve_job_def("streams").execute_in_process(
            instance=instance, raise_on_error=False,
            run_config={"ops": {"run_streams": {"config": {"jobs": ["purchase_metrics", "no_such_job"]}}}})
        assert not bad.success
        failure = next(e for e in bad.all_events if e.event_type_value == "STEP_FAILURE")
        assert "unknown job(s) no_such_job" in str(failure.event_specific_data.error)

    # each query of the application wrote what its job alone would: against independent oracles
    files = oracle.files_in_arrival_order(Path(settings.landing_dir("payments")))
    truth = oracle.replay_stream([[line for p in files[i:i + 6] for line in oracle.read_lines(p)]
                                  for i in range(0, len(files), 6)])
    assert spark.table("lake.payments.purchase_metrics").count() == len(truth.closed) > 0
    on_time, late, watermark = oj.keyed_truth(oj.batches(Path(settings.landing), ["payments"], 6), lambda e: True, 5_000)
    expected = oj.large_amounts([e for e in on_time if e["t_ms"] <= watermark])
    alerts = {tuple(r) for r in spark.sql(
        "SELECT card_id, event_id, previous_event_id FROM lake.fraud.large_amount_alerts").collect()}
    assert alerts == expected and expected


def test_materializing_a_partition_runs_the_bounded_twin_and_reports_reconciliation(spark, small_landing):
    """The reconciliation is evaluated inside the run, from the comparison made before the replace,
    one per day, linked to the day's materialization; the same day materialized again (retries,
    schedules) works every time (it used to fail on a UNIQUE constraint of runless evaluations)."""
    from streaming.project import get_job
    from streaming.run.runner import run_stream

    settings = write_config(small_landing, {"purchase_metrics": {"max_files_per_trigger": 6}})
    run_stream(spark, settings, get_job("purchase_metrics", settings), available_now=True, progress=None,
               install_signal_handlers=False)
    defs = defs_for(settings)
    assets = [a for a in defs.assets if isinstance(a, dg.AssetsDefinition) and MAIN in a.keys]
    with dg.instance_for_test() as instance:
        runs = []
        for attempt in range(3):
            result = dg.materialize(assets, instance=instance, partition_key=DAY, resources=defs.resources,
                                    run_config={"ops": {"purchase_metrics_bounded": {"config": {"force": True}}}})
            assert result.success, f"materialization {attempt + 1} of the same day failed"
            runs.append(result.run_id)
            record = latest_check(instance, MAIN, "reconciliation", DAY)
            evaluation = evaluation_of(record)
            assert record.run_id == result.run_id and evaluation.partition == DAY
            mat = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=MAIN, asset_partitions=[DAY]),
                                                  limit=1).records[0]
            assert evaluation.target_materialization_data.storage_id == mat.storage_id
            assert mat.event_log_entry.run_id == result.run_id
            if attempt == 0:
                # the first comparison saw the stream's own output, with its late events set aside
                assert evaluation.passed and evaluation.metadata["late"].value > 0
                assert "before the replace" in evaluation.description
            else:
                # later runs compare the stream's tables as the previous backfill left them, never vacuously
                # against this run's own result (that comparison happens before the replace)
                assert evaluation.metadata["compared"].value > 0
        assert len(set(runs)) == 3
        history = instance.event_log_storage.get_asset_check_execution_history(
            dg.AssetCheckKey(MAIN, "reconciliation"), limit=10)
        assert {r.run_id for r in history} == set(runs)
    expected = oracle.bounded_windows(Path(settings.landing_dir("payments")))
    assert spark.table("lake.payments.purchase_metrics").count() == len(expected)


def test_a_day_the_stream_still_writes_is_refused_with_the_launchpad_fix(spark, small_landing):
    """Without ``force`` a day the live stream still owns fails the run with a ``dg.Failure`` that
    names the run config to set, and nothing is replaced."""
    from streaming.project import get_job
    from streaming.run.runner import run_stream

    settings = write_config(small_landing, {"purchase_metrics": {"max_files_per_trigger": 6}})
    run_stream(spark, settings, get_job("purchase_metrics", settings), available_now=True, progress=None,
               install_signal_handlers=False)
    from streaming.checkpoint.lease import Lease

    before = {tuple(r) for r in spark.table("lake.payments.purchase_metrics").collect()}
    defs = defs_for(settings)
    assets = [a for a in defs.assets if isinstance(a, dg.AssetsDefinition) and MAIN in a.keys]
    running = Lease(settings.checkpoint_dir("purchase_metrics"), job="purchase_metrics").acquire("stream")  # (live)
    with dg.instance_for_test() as instance:
        try:
            result = dg.materialize(assets, instance=instance, partition_key=DAY, resources=defs.resources,
                                    raise_on_error=False)
        finally:
            running.release()
        assert not result.success
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        error = failure.step_failure_data.error
        assert error.cls_name == "Failure", error.cls_name
        assert "force: true" in error.message and "purchase_metrics_bounded" in error.message
        assert "Traceback" not in failure.step_failure_data.user_failure_data.description
        # the day's reconciliation says why it was not compared (not "execution failed")
        record = latest_check(instance, MAIN, "reconciliation", DAY)
        assert record.run_id == result.run_id and "refused" in evaluation_of(record).description
        assert not evaluation_of(record).passed and evaluation_of(record).severity == dg.AssetCheckSeverity.WARN
    assert {tuple(r) for r in spark.table("lake.payments.purchase_metrics").collect()} == before


def test_dbt_builds_the_marts_on_the_session_and_they_match_pandas(spark, small_landing):
    """dbt-spark (method: session) runs in this process, on this SparkSession."""
    from dbt.cli.main import dbtRunner

    from orchestration.dbt import DBT_DIR, write_profiles
    from streaming.project import registry
    from streaming.run.runner import run_stream
    from streaming.io.tables import job_sinks

    settings = small_landing.with_job("purchase_metrics", max_files_per_trigger=6)
    for job in registry().values():
        job_sinks(spark, settings, job)  # every source table exists (most stay empty here)
    run_stream(spark, settings, registry()["purchase_metrics"], available_now=True, progress=None,
               install_signal_handlers=False)
    profiles = write_profiles(settings)
    try:
        result = dbtRunner().invoke(["build", "--project-dir", str(DBT_DIR), "--profiles-dir", str(profiles),
                                     "--target-path", str(settings.home / "dbt-target")])
    finally:
        spark.conf.unset("spark.sql.defaultCatalog")
    assert result.success, result.exception
    windows = spark.table("lake.payments.purchase_metrics").toPandas()
    windows["day"] = windows["window_start"].dt.date
    expected = windows.groupby(["user_id", "day"]).agg(payments=("event_count", "sum"), amount=("amount_sum", "sum"))
    mart = spark.table("lake.marts.user_daily_activity").toPandas().set_index(["user_id", "day"])
    assert len(mart) == len(expected) > 0
    for key, row in expected.iterrows():
        assert mart.loc[key, "payments"] == row.payments and Decimal(mart.loc[key, "amount"]) == Decimal(row.amount)


# -- sensors and schedules over real checkpoints ------------------------------------------

@pytest.fixture
def streamed(spark, small_landing):
    from streaming.project import get_job
    from streaming.run.runner import run_stream

    settings = write_config(small_landing, {"purchase_metrics": {"max_files_per_trigger": 6}})
    run_stream(spark, settings, get_job("purchase_metrics", settings), available_now=True, progress=None,
               install_signal_handlers=False)
    return settings


def run_health_sensor(defs, instance, cursor=None):
    sensor = defs.resolve_sensor_def("checkpoint_health")
    context = dg.build_sensor_context(instance=instance, cursor=cursor, resources=defs.resources,
                                      definitions=defs)
    return sensor(context), context


def test_checkpoint_health_sensor_reports_healthy_stalled_and_corrupt_checkpoints(streamed):
    defs = defs_for(streamed)
    checkpoint = Path(streamed.checkpoint_dir("purchase_metrics"))
    with dg.instance_for_test() as instance:
        run_health_sensor(defs, instance)
        assert evaluation_of(latest_check(instance, STREAM, "checkpoint_health")).passed
        # the same tick observed the landing folders (no run): the files there, none pending
        landing_files = [p for p in Path(streamed.landing_dir("payments")).iterdir() if not p.name.startswith(".")]
        seen = instance.fetch_observations(dg.AssetKey(["landing", "payments"]), limit=1).records
        observed = seen[0].event_log_entry.asset_observation.metadata
        assert observed["files"].value == len(landing_files) > 0
        # purchase_metrics read them all; another reader of payments has never run: every file waits for it
        assert observed["slowest_reader"].value != "purchase_metrics" and observed["pending_files"].value == len(landing_files)

        # stalled: new input waits, and the last commit is an hour old
        landing = Path(streamed.landing_dir("payments"))
        (landing / "late-arrival.jsonl").write_text(oracle.read_lines(oracle.files_in_arrival_order(landing)[0])[0] + "\n")
        hour_ago = time.time() - 3600
        os.utime(landing / "late-arrival.jsonl", (hour_ago, hour_ago))
        for commit in (checkpoint / "commits").iterdir():
            os.utime(commit, (hour_ago, hour_ago))
        run_health_sensor(defs, instance)
        idle = evaluation_of(latest_check(instance, STREAM, "checkpoint_health"))
        # no stream runs: input waiting is a warning (on-demand use), not a stall
        assert not idle.passed and idle.severity == dg.AssetCheckSeverity.WARN and "idle" in idle.description
        # a process runs the stream and commits nothing for an hour: stalled
        (checkpoint / "lakestream" / "running").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
        run_health_sensor(defs, instance)
        stalled = evaluation_of(latest_check(instance, STREAM, "checkpoint_health"))
        assert not stalled.passed and stalled.severity == dg.AssetCheckSeverity.ERROR
        assert stalled.metadata["stalled"].value is True
        (checkpoint / "lakestream" / "running").unlink()

        # corrupt: the newest offset-log entry is garbage
        newest = max((p for p in (checkpoint / "offsets").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
        newest.write_text("v1\n{not json")
        run_health_sensor(defs, instance)
        corrupt = evaluation_of(latest_check(instance, STREAM, "checkpoint_health"))
        assert corrupt.metadata["corrupt"].value is True and "offsets" in corrupt.description


def test_supervisor_restarts_a_crashed_stream_with_backoff_but_not_a_terminated_one(streamed):
    from streaming.project import get_job

    defs = defs_for(streamed)
    job = get_job("purchase_metrics")
    with dg.instance_for_test() as instance:
        assert supervise(instance, job) is None  # nobody asked for it to run
        DesiredState(instance, job.name).set("running", trigger_interval_seconds=1)
        first = supervise(instance, job)
        assert first is not None and first.run_config["ops"]["purchase_metrics"]["config"]["mode"] == "continuous"
        assert first.run_config["ops"]["purchase_metrics"]["config"]["trigger_interval_seconds"] == 1

        failed = defs.resolve_job_def("purchase_metrics_stream").execute_in_process(
            instance=instance, raise_on_error=False,
            run_config=stream_config("continuous", from_savepoint="purchase_metrics-20990101T000000000Z-b1"))
        assert not failed.success  # an unknown savepoint: the run fails, the stream should still run
        now = time.time()
        assert supervise(instance, job, now=now) is None  # within the 30 s backoff
        retry = supervise(instance, job, now=now + 31)
        assert retry.tags["lakestream/restart-attempt"] == "2" and retry.tags["lakestream/restart-of"] == failed.run_id
        assert retry.tags["lakestream/restart-reason"] == "crashed"
        check = evaluation_of(latest_check(instance, STREAM, "stream_supervisor"))
        assert "restarted purchase_metrics_stream" in check.description

        run = instance.get_run_by_id(failed.run_id)
        instance.report_run_canceled(run)  # as if terminated from the UI
        assert supervise(instance, job, now=now + 600) is None
        assert DesiredState(instance, job.name).get()["state"] == "stopped"


def test_savepoint_before_deploy_stops_the_stream_and_the_supervisor_resumes_from_the_savepoint(spark, small_landing):
    import threading

    from streaming.project import get_job
    from streaming.run.runner import run_stream

    settings = write_config(small_landing, {"purchase_metrics": {"max_files_per_trigger": 2, "trigger_interval": "1s"}})
    job = get_job("purchase_metrics", settings)
    stop, errors = threading.Event(), []

    def stream():
        try:
            run_stream(spark, settings, job, available_now=False, progress=None, stop_event=stop,
                       install_signal_handlers=False)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    runner = threading.Thread(target=stream, daemon=True)
    runner.start()
    commits = Path(settings.checkpoint_dir(job.name)) / "commits"
    deadline = time.monotonic() + 120
    while not (commits.is_dir() and any(p.name.isdigit() for p in commits.iterdir())):
        assert time.monotonic() < deadline and not errors, errors
        time.sleep(0.5)
    defs = defs_for(settings)
    with dg.instance_for_test() as instance:
        DesiredState(instance, job.name).set("running", trigger_interval_seconds=1)
        result = defs.resolve_job_def("savepoint_before_deploy").execute_in_process(instance=instance)
        assert result.success
        runner.join(timeout=60)
        assert not runner.is_alive() and not errors, errors
        tags = instance.get_run_by_id(result.run_id).tags
        savepoint = tags["lakestream/savepoint.purchase_metrics"]
        assert (Path(settings.savepoints) / "purchase_metrics" / savepoint / "manifest.json").exists()
        request = supervise(instance, job)
        assert request.run_config["ops"]["purchase_metrics"]["config"]["from_savepoint"] == savepoint
        assert request.tags["lakestream/restart-reason"] == "savepoint"
        assert "from_savepoint" not in DesiredState(instance, job.name).get()  # a later restart resumes normally


def test_daily_backfill_schedule_asks_for_yesterdays_partition(lake):
    defs = defs_for(lake)
    schedule = defs.resolve_schedule_def("daily_backfill_schedule")
    when = datetime(2026, 11, 21, 1, 30, tzinfo=timezone.utc)
    with dg.instance_for_test() as instance:
        context = dg.build_schedule_context(instance=instance, scheduled_execution_time=when,
                                            repository_def=defs.get_repository_def())
        requests = schedule.evaluate_tick(context).run_requests
    assert [r.partition_key for r in requests] == ["2026-11-20"]
    assert defs.resolve_job_def("daily_backfill").partitions_def is not None


def test_the_savepoint_schedule_skips_a_tick_while_a_savepoint_run_is_queued_or_running(lake):
    defs = defs_for(lake)
    schedule = defs.resolve_schedule_def("savepoint_before_deploy_schedule")
    job = defs.resolve_job_def("savepoint_before_deploy")
    when = datetime(2026, 11, 21, 4, 0, tzinfo=timezone.utc)
    with dg.instance_for_test() as instance:
        def tick():
            context = dg.build_schedule_context(instance=instance, scheduled_execution_time=when,
                                                repository_def=defs.get_repository_def())
            return schedule.evaluate_tick(context)

        assert len(tick().run_requests) == 1  # none under way: a savepoint run
        for status in (dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED):  # (a queued run needs a code
            # location of its own to be created: the status list in the schedule names it with these)
            run = instance.create_run_for_job(job, status=status)
            skipped = tick()
            assert not skipped.run_requests and run.run_id in skipped.skip_message, skipped
            assert status.value.lower() in skipped.skip_message
            instance.report_run_failed(run)  # (it ends: the next tick takes its savepoint)
            assert len(tick().run_requests) == 1
        other = instance.create_run_for_job(defs.resolve_job_def("daily_backfill"), status=dg.DagsterRunStatus.STARTED)
        assert len(tick().run_requests) == 1, "only a savepoint run holds the schedule back"
        instance.report_run_failed(other)


def test_health_sensor_and_volume_checks_judge_a_checkpoint_on_an_object_store_as_on_local_disk(streamed):
    """The same checkpoint, read where a cluster keeps it (memory:// stands in for s3a://): the
    checkpoint_health sensor and the late/quarantine volume checks reach the same verdicts."""
    import yaml

    from orchestration.resources import LakestreamResource
    from tests.objectstore import remove, upload

    checkpoints, landing = upload(streamed, "purchase_metrics")
    remote_home = streamed.home.parent / "remote-home"
    remote_home.mkdir()
    local_yaml = yaml.safe_load((streamed.home / "lakestream.yaml").read_text())
    (remote_home / "lakestream.yaml").write_text(yaml.safe_dump({**local_yaml, "checkpoints": checkpoints, "landing": landing}))
    remote = build_definitions(home=str(remote_home))
    local = defs_for(streamed)

    def verdicts(defs, home):
        with dg.instance_for_test() as instance:
            run_health_sensor(defs, instance)
            record = latest_check(instance, STREAM, "checkpoint_health")
            health = evaluation_of(record) if record else None
        resource = LakestreamResource(home=str(home))
        volumes = {}
        for check in (dg.AssetCheckKey(STREAM, "late_volume"),
                      dg.AssetCheckKey(dg.AssetKey(["lake", "quarantine", "payments"]), "quarantine_volume")):
            fn = next(c for c in defs.asset_checks if check in c.check_keys)
            result = fn(lakestream=resource)
            volumes[check.name] = (result.passed, {k: v.value for k, v in result.metadata.items()})
        return health, volumes

    try:
        local_health, local_volumes = verdicts(local, streamed.home)
        remote_health, remote_volumes = verdicts(remote, remote_home)
        assert remote_health is not None, "the sensor did not report the checkpoint on the object store"
        assert (remote_health.passed, remote_health.metadata["status"].value) == \
            (local_health.passed, local_health.metadata["status"].value) == (True, "healthy")
        assert remote_volumes == local_volumes
        assert local_volumes["late_volume"][1]["late"] > 0 and local_volumes["quarantine_volume"][1]["quarantined"] > 0

        # and a damage on the object store is seen there too
        import fsspec

        fs = fsspec.filesystem("memory")
        offsets = f"{checkpoints}/purchase_metrics/offsets"
        newest = max((p for p in fs.ls(offsets, detail=False) if p.rsplit("/", 1)[-1].isdigit()),
                     key=lambda p: int(p.rsplit("/", 1)[-1]))
        fs.pipe(newest, b"v1\n{not json")
        damaged, _ = verdicts(remote, remote_home)
        assert damaged.metadata["corrupt"].value is True and not damaged.passed
    finally:
        remove(checkpoints)


def test_a_run_outside_dagster_is_recorded_as_materializations(spark, small_landing):
    """`make demo` (run from a shell) shows in the UI: its tables materialized per day, with its figures."""
    from orchestration.record import record_outside_run
    from streaming.project import get_job

    from batch.reconcile import DayResult, ReconcileReport

    job = get_job("purchase_metrics", small_landing)
    compared = ReconcileReport(job.name, datetime(2026, 11, 20, tzinfo=timezone.utc), datetime(2026, 11, 21, tzinfo=timezone.utc),
                               1_763_600_000_000, days=[DayResult(date.fromisoformat(DAY), 40, 37, 2, 1, 0)])
    differs = ReconcileReport(job.name, compared.start, compared.end, 1_763_600_000_000,
                              days=[DayResult(date.fromisoformat(DAY), 40, 36, 2, 1, 1)])  # one unexplained
    check = dg.AssetCheckKey(MAIN, "reconciliation")
    with dg.instance_for_test() as instance:
        for report in (compared, differs, compared):  # each demo records its own comparison (no collision)
            where = record_outside_run(job, [DAY], what="lakestream demo", instance=instance,
                                       metadata={"lines": 10, "watermark_ms": 1_763_600_000_000}, reconciliation=report)
            # the demo's comparison is the day's reconciliation check (not "Not Evaluated" right after `make demo`,
            # nor the first demo's after a second)
            evaluation = instance.event_log_storage.get_latest_asset_check_execution_by_key([check])[check]
            data = evaluation.event.dagster_event.event_specific_data
            assert data.passed is (report is compared) and data.partition == DAY, data
            assert data.metadata["unexplained"].value == report.days[0].unexplained
        assert where is not None
        records = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=MAIN, asset_partitions=[DAY]),
                                                  limit=5).records
        assert len(records) == 3
        meta = records[0].asset_materialization.metadata
        assert meta["recorded_from"].value == "lakestream demo" and meta["watermark_time"].value == 1_763_600_000
        late = instance.fetch_materializations(dg.AssetKey(["lake", "payments", "purchase_metrics_late"]), limit=1)
        assert late.records

        # the demo created every job's table: those Dagster never saw materialized are recorded as existing, so
        # materializing a mart does not warn that an upstream "has not been materialized yet" (the UI's test:
        # a materializable upstream asset without any materialization)
        from orchestration.record import record_tables_created
        from streaming.project import registry

        graph = defs_for(small_landing).resolve_asset_graph()
        marts = [k for k in graph.get_all_asset_keys() if k.path[:2] == ["lake", "marts"]]
        upstream = {p for m in marts for p in graph.get(m).parent_keys if graph.get(p).is_materializable}
        assert MAIN in upstream and len(upstream) >= 6, upstream
        missing = [k for k in upstream if instance.get_latest_materialization_event(k) is None]
        assert missing and MAIN not in missing  # before: every job's table but the demo's is "never materialized"
        created = record_tables_created(list(registry(small_landing).values()), what="lakestream demo", instance=instance)
        assert "lake.payments.purchase_metrics" not in created and len(created) >= len(missing)
        assert [k for k in upstream if instance.get_latest_materialization_event(k) is None] == []
        assert record_tables_created(list(registry(small_landing).values()), what="lakestream demo", instance=instance) == []
        assert len(instance.fetch_materializations(MAIN, limit=10).records) == 3  # the demo's, not a creation


def test_a_fresh_dagster_home_is_created_once_before_its_processes_start(tmp_path):
    """`make ui` and the e2e servers prepare DAGSTER_HOME first: the webserver, the daemon and their
    code servers then find stamped SQLite databases instead of all creating them at once (two
    processes stamping together left two alembic heads and a code location that failed to load)."""
    import sqlite3
    from concurrent.futures import ProcessPoolExecutor

    from orchestration.record import ensure_dagster_yaml

    home = tmp_path / "dagster"
    ensure_dagster_yaml(str(home))
    databases = sorted(home.rglob("*.db"))
    assert {p.name for p in databases} >= {"runs.db", "index.db", "schedules.db"}, databases
    heads = {p.name: sqlite3.connect(p).execute("SELECT version_num FROM alembic_version").fetchall() for p in databases}
    assert all(len(rows) == 1 for rows in heads.values()), heads
    with ProcessPoolExecutor(4) as pool:  # four processes opening it at once, as `dagster dev` does
        counts = list(pool.map(_runs_in, [str(home)] * 4))
    assert counts == [0, 0, 0, 0]


def _runs_in(home: str) -> int:
    with dg.DagsterInstance.from_config(home) as instance:
        return instance.get_runs_count()


def test_one_run_per_stream_the_queue_limits_a_stream_tag_and_an_overlap_is_refused_in_one_line(tmp_path, capsys):
    """The written dagster.yaml limits each `lakestream/stream` value to one run (the e2e test launches a
    stream twice against it); a job streamed alone while an earlier application run streams it is refused
    before Spark starts, naming that run; the earlier run is never the one refused; an old dagster.yaml
    without the block is pointed out."""
    from dagster._core.storage.dagster_run import DagsterRun, DagsterRunStatus

    from orchestration.record import ensure_dagster_yaml
    from orchestration.streams import APP_JOB, JOBS_TAG, streaming_elsewhere
    from orchestration.tables import STREAM_TAG

    home = tmp_path / "dagster"
    ensure_dagster_yaml(str(home))
    with dg.DagsterInstance.from_config(str(home)) as instance:
        limits = instance.get_concurrency_config().run_queue_config.tag_concurrency_limits
        assert limits == [{"key": STREAM_TAG, "value": {"applyLimitPerUniqueValue": True}, "limit": 1}], limits
        app = DagsterRun(job_name=APP_JOB, run_id="a" * 36, status=DagsterRunStatus.STARTED,
                         tags={STREAM_TAG: APP_JOB, JOBS_TAG: "purchase_metrics,decline_velocity"})
        instance.add_run(app)
        time.sleep(0.01)
        alone = DagsterRun(job_name="purchase_metrics_stream", run_id="b" * 36, status=DagsterRunStatus.STARTING,
                           tags={STREAM_TAG: "purchase_metrics", JOBS_TAG: "purchase_metrics"})
        instance.add_run(alone)
        other = DagsterRun(job_name="user_sessions_stream", run_id="c" * 36, status=DagsterRunStatus.STARTING,
                           tags={STREAM_TAG: "user_sessions", JOBS_TAG: "user_sessions"})
        instance.add_run(other)
        refused = streaming_elsewhere(instance, alone.run_id, ["purchase_metrics"])
        assert refused is not None and "\n" not in refused
        assert refused.startswith(f"purchase_metrics already stream(s) in run {app.run_id} ({APP_JOB}, started since")
        assert "terminate that run first" in refused
        assert streaming_elsewhere(instance, app.run_id, ["purchase_metrics", "decline_velocity"]) is None  # the earlier runs on
        assert streaming_elsewhere(instance, other.run_id, ["user_sessions"]) is None  # no overlap
        instance.report_run_canceled(instance.get_run_by_id(app.run_id))
        assert streaming_elsewhere(instance, alone.run_id, ["purchase_metrics"]) is None  # the application ended

    old = tmp_path / "old"
    old.mkdir()
    (old / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    capsys.readouterr()
    ensure_dagster_yaml(str(old))
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and "lakestream/stream" in warning and "docs/dagster.md" in warning


def test_a_stream_run_whose_process_is_gone_is_failed_and_restarted_by_the_supervisor(tmp_path):
    """A killed pod or a rebooted machine leaves the run Started with nobody to report its end: the supervisor
    marks it failed, naming why, once its process is gone (this host: pid and start time; another host: the
    checkpoint's lease not renewed) and it logged nothing for a while; then restarts it as a crash."""
    import json
    import socket
    import subprocess

    from dagster._core.storage.dagster_run import DagsterRun, DagsterRunStatus

    from orchestration.sensors import DEAD_AFTER_S
    from orchestration.streams import PROCESS_TAG, process_tags
    from streaming.checkpoint.lease import Lease, control_dir
    from streaming.project import get_job

    job = get_job("purchase_metrics")
    gone = subprocess.Popen(["true"])
    gone.wait()
    lease = Lease(str(tmp_path / "checkpoints" / job.name), job=job.name)
    with dg.instance_for_test() as instance:
        DesiredState(instance, job.name).set("running", trigger_interval_seconds=1)

        def started(run_id: str, process: str) -> DagsterRun:
            run = DagsterRun(job_name="purchase_metrics_stream", run_id=run_id, status=DagsterRunStatus.STARTED,
                             tags={"lakestream/jobs": job.name, PROCESS_TAG: process})
            instance.add_run(run)
            return run

        alive = started("a" * 36, process_tags()[PROCESS_TAG])  # this very process: alive
        later = time.time() + DEAD_AFTER_S + 1
        assert supervise(instance, job, now=later, lease=lease) is None  # a run is active
        assert instance.get_run_by_id(alive.run_id).status == DagsterRunStatus.STARTED
        instance.report_run_canceled(instance.get_run_by_id(alive.run_id))
        DesiredState(instance, job.name).set("running", trigger_interval_seconds=1)

        dead = started("b" * 36, f"{socket.gethostname()}:{gone.pid}:")
        assert supervise(instance, job, now=time.time(), lease=lease) is None  # gone, but it logged just now
        assert instance.get_run_by_id(dead.run_id).status == DagsterRunStatus.STARTED
        restart = supervise(instance, job, now=later + 30, lease=lease)
        failed = instance.get_run_by_id(dead.run_id)
        assert failed.status == DagsterRunStatus.FAILURE
        message = [e.message for e in instance.all_logs(dead.run_id) if e.dagster_event and
                   e.dagster_event.event_type_value == "PIPELINE_FAILURE"][0]
        assert f"its process (pid {gone.pid} on {socket.gethostname()}) is gone" in message
        assert restart is not None and restart.tags["lakestream/restart-of"] == dead.run_id
        assert restart.tags["lakestream/restart-reason"] == "crashed"

        # another host: judged by the lease it holds (renewed within its ttl: alive; not since: dead)
        folder = Path(control_dir(lease.checkpoint))
        folder.mkdir(parents=True)
        now_ms = int(time.time() * 1000)
        holder = {"generation": 1, "host": "pod-7", "pid": 41, "purpose": "stream", "since_ms": now_ms - 600_000,
                  "renewed_ms": now_ms - 5_000, "ttl_ms": 60_000}
        (folder / "lease-000000000001.json").write_text(json.dumps(holder))
        remote = started("c" * 36, "pod-7:41:99")
        assert supervise(instance, job, now=later, lease=lease) is None
        assert instance.get_run_by_id(remote.run_id).status == DagsterRunStatus.STARTED
        (folder / "lease-000000000001.json").write_text(json.dumps({**holder, "renewed_ms": now_ms - 120_000}))
        # (judged DEAD_AFTER_S after the run was added, not after `later`: a loaded machine takes seconds to get here)
        supervise(instance, job, now=time.time() + DEAD_AFTER_S + 1, lease=lease)
        assert instance.get_run_by_id(remote.run_id).status == DagsterRunStatus.FAILURE


def test_a_second_launch_canceled_while_it_waited_in_the_queue_does_not_stop_the_stream():
    """Terminating a duplicate launch that the run queue held back is not a request to stop the stream (a run
    that ran and was terminated is): the supervisor keeps the stream running."""
    from dagster._core.storage.dagster_run import DagsterRun, DagsterRunStatus

    from streaming.project import get_job

    job = get_job("purchase_metrics")
    with dg.instance_for_test() as instance:
        DesiredState(instance, job.name).set("running", trigger_interval_seconds=1)
        instance.add_run(DagsterRun(job_name="purchase_metrics_stream", run_id="d" * 36, status=DagsterRunStatus.CANCELED,
                                    tags={"lakestream/jobs": job.name}))
        request = supervise(instance, job)
        assert request is not None and request.tags["lakestream/restart-reason"] == "ended"
        assert DesiredState(instance, job.name).get()["state"] == "running"


def test_durations_are_seconds_the_run_config_checks_and_a_restart_reads_an_older_instances_text(lake):
    """A duration in a stream's run config is a number of seconds, so Dagster's validation (the launchpad's)
    refuses '5 sec' before any run starts; a desired state kept by an older version ('5s') still restarts."""
    from streaming.project import get_job

    stream = defs_for(lake).resolve_job_def("purchase_metrics_stream")
    for bad in ({"trigger_interval_seconds": "5 sec"}, {"materialize_every_seconds": "10s"}, {"trigger_interval": "5s"}):
        with pytest.raises(dg.DagsterInvalidConfigError) as refused:
            dg.validate_run_config(stream, stream_config(**bad))
        assert next(iter(bad)) in str(refused.value)
    dg.validate_run_config(stream, stream_config("continuous", trigger_interval_seconds=0.25, rollover_after_seconds=3600))
    job = get_job("purchase_metrics")
    with dg.instance_for_test() as instance:
        DesiredState(instance, job.name).set("running", trigger_interval="5s", materialize_every="0s", rollover_after="2h")
        config = supervise(instance, job).run_config
        assert config["ops"]["purchase_metrics"]["config"] == {
            "mode": "continuous", "trigger_interval_seconds": 5.0, "materialize_every_seconds": 0.0,
            "rollover_after_seconds": 7200.0, "max_files_per_trigger": 0, "from_savepoint": ""}
        dg.validate_run_config(stream, config)


def test_a_termination_after_the_queries_stopped_is_still_a_stop_request_not_an_interrupt():
    """A savepoint stops a stream's queries and Dagster's termination lands a moment later, while the step writes its
    last log lines: the step takes it as the stop request it is (no KeyboardInterrupt), and puts the handlers back."""
    import os
    import signal
    import threading

    from streaming.run.runner import restore_signals, take_signals

    before = signal.getsignal(signal.SIGINT)
    received: list[str] = []
    stop = threading.Event()
    outer = take_signals(received, stop)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(100):
            if received:
                break
            threading.Event().wait(0.01)
    finally:
        restore_signals(outer)
    assert received == ["SIGINT"] and stop.is_set()
    assert signal.getsignal(signal.SIGINT) is before
