"""What ran outside Dagster (``lakestream demo``, ``run``, ``backfill`` from a shell), recorded in the
Dagster instance of ``$DAGSTER_HOME`` as runless materializations, so the UI shows the tables as
materialized, with the figures of the run, instead of "Never materialized"."""

from __future__ import annotations

import os
import sys

import dagster as dg

from streaming.declaration import Job
from streaming.time import describe_watermark, is_finite

from .tables import STREAM_TAG, table_key


DAGSTER_YAML = """\
# The Dagster instance of lakestream (written once by `make ui` / `make demo`; yours to edit).
# Embedded default: run, event-log and schedule storage in SQLite under this folder.
# On a cluster, keep them in Postgres instead (pip install dagster-postgres):
#   storage:
#     postgres:
#       postgres_url:
#         env: DAGSTER_PG_URL
telemetry:
  enabled: false
# One run per stream: a stream's runs carry the tag lakestream/stream (the job's name; "streams" for an
# application of several jobs), and the run queue starts one run per value at a time. A second launch
# of a running stream waits as Queued ("blocked by tag concurrency limits") until the first ends;
# terminate it from the Runs page if it was a mistake. Keep this block in a deployment's dagster.yaml.
concurrency:
  runs:
    tag_concurrency_limits:
      - key: lakestream/stream
        value:
          applyLimitPerUniqueValue: true
        limit: 1
# Run monitoring (the daemon): a run stuck starting or canceling is failed after 3 minutes. A stream run whose
# process died is marked failed by the code server that launched it, or else by lakestream's supervisor,
# which then starts the stream again (a new run: the checkpoint resumes it exactly-once); Dagster's own
# resume of a run is off, as the default run launcher cannot resume one.
run_monitoring:
  enabled: true
  start_timeout_seconds: 180
  cancel_timeout_seconds: 180
  max_resume_run_attempts: 0
  poll_interval_seconds: 30
"""



POSTGRES_STORAGE = """\
# Run, event-log and schedule storage in PostgreSQL (dagster-postgres).
storage:
  postgres:
    postgres_url: {url}
"""


def ensure_dagster_yaml(dagster_home: str | None = None, postgres_url: str | None = None) -> str:
    """Write ``$DAGSTER_HOME/dagster.yaml`` unless one exists, and create the instance's storage;
    returns the yaml's path. Call it before starting Dagster's processes (``make ui`` does).
    ``postgres_url``: the instance keeps its storage in PostgreSQL (a deployment) instead of SQLite files."""
    home = dagster_home or os.environ.get("DAGSTER_HOME")
    if not home:
        raise SystemExit("DAGSTER_HOME is not set; run `make ui` (it sets $LAKESTREAM_HOME/dagster) or export it")
    os.makedirs(home, exist_ok=True)
    path = os.path.join(home, "dagster.yaml")
    if not os.path.exists(path):
        with open(path, "w") as out:
            out.write(DAGSTER_YAML + (POSTGRES_STORAGE.format(url=postgres_url) if postgres_url else ""))
    else:
        with open(path) as existing:
            if STREAM_TAG not in existing.read():
                print(f"lakestream: {path} has no run limit on the tag {STREAM_TAG}: two runs of one stream "
                      "can start (the second then fails on the checkpoint's lease); add the `concurrency:` block "
                      "of docs/dagster.md", file=sys.stderr)
    _create_storage(home)
    return path


def _create_storage(home: str) -> None:
    """Create (and stamp) the instance's storage now, in this one process: the webserver, the daemon
    and their code servers all start at once, and on a fresh SQLite home each would create the
    databases itself; two stamping at the same moment leave ``alembic_version`` with two rows
    ("more than one head present", dagster-io/dagster#27390) and the code location fails to load."""
    with dg.DagsterInstance.from_config(home) as instance:
        instance.run_storage, instance.event_log_storage, instance.schedule_storage  # noqa: B018 - created on access


def record_outside_run(job: Job, days: list[str], *, what: str, metadata: dict,
                       instance: dg.DagsterInstance | None = None, reconciliation=None) -> str | None:
    """Report the job's main and late tables as materialized for ``days`` (and its quarantine tables), and
    ``reconciliation`` (a comparison of the stream with its bounded twin) as the days' reconciliation check.
    Returns where it was recorded, or None when there is no Dagster instance to record in."""
    if instance is None:
        if not os.environ.get("DAGSTER_HOME"):
            return None
        ensure_dagster_yaml()
        instance = dg.DagsterInstance.get()
    meta = {"recorded_from": what, **metadata}
    if "watermark_ms" in meta:
        watermark = meta.pop("watermark_ms")
        meta["watermark"] = describe_watermark(watermark)
        if is_finite(watermark):
            meta["watermark_time"] = dg.MetadataValue.timestamp(watermark / 1000)
    for table in (job.sink, job.late_sink):
        for day in days or [None]:
            instance.report_runless_asset_event(dg.AssetMaterialization(
                asset_key=table_key(table), partition=day, metadata=meta,
                description=f"{what} (outside Dagster)"))
    for source in job.sources:
        instance.report_runless_asset_event(dg.AssetMaterialization(
            asset_key=table_key(source.quarantine), metadata={"recorded_from": what},
            description=f"{what} (outside Dagster)"))
    if reconciliation is not None and days:
        from .assets import reconciliation_evaluations

        from sqlalchemy.exc import IntegrityError

        for evaluation in reconciliation_evaluations(job, reconciliation, days, instance):
            _forget_runless_evaluation(instance, evaluation)
            try:
                instance.report_runless_asset_event(evaluation)
            except IntegrityError:  # (an instance where the earlier one could not be forgotten: it stays, and a
                pass                # run's evaluation, a backfill's say, supersedes it)
    return os.environ.get("DAGSTER_HOME") or "the given instance"


def record_tables_created(jobs: list[Job], *, what: str, instance: dg.DagsterInstance | None = None) -> list[str]:
    """Report each job table that exists but that Dagster has never seen materialized (created empty by
    ``lakestream init`` or the demo) as materialized once, without a partition: the UI then shows that the
    table exists instead of "Never materialized", and building a dbt mart that reads it no longer warns that
    its upstream "has not been materialized yet" (the mart builds on the empty table). A table Dagster has
    seen materialized is left alone. Call it after the tables were created. Returns the tables reported."""
    if instance is None:
        if not os.environ.get("DAGSTER_HOME"):
            return []
        ensure_dagster_yaml()
        instance = dg.DagsterInstance.get()
    tables = [t for job in jobs for t in (job.sink, job.late_sink, *(s.quarantine for s in job.sources))]
    reported = []
    for table in dict.fromkeys(tables):  # (a source's quarantine is shared by the jobs that read it)
        key = table_key(table)
        if instance.get_latest_materialization_event(key) is not None:
            continue
        instance.report_runless_asset_event(dg.AssetMaterialization(
            asset_key=key, metadata={"recorded_from": what, "table": table.name},
            description=f"the table exists: created by {what} (outside Dagster), before any run wrote to it"))
        reported.append(table.name)
    return reported


def _forget_runless_evaluation(instance: dg.DagsterInstance, evaluation: dg.AssetCheckEvaluation) -> None:
    """Dagster 1.13 indexes one runless evaluation per check and partition (a unique index over the check, the
    run id, empty when runless, and the partition): a second `make demo` could not record its comparison, and
    the check kept showing the first one. The earlier runless row leaves the index (its event stays in the
    event log, as history), so this evaluation becomes the check's latest. Dagster's SQL storages only; any
    other storage keeps the first evaluation."""
    try:
        from dagster._core.instance.utils import RUNLESS_RUN_ID
        from dagster._core.storage.event_log.schema import AssetCheckExecutionsTable as T

        with instance.event_log_storage.index_connection() as conn:
            conn.execute(T.delete().where((T.c.asset_key == evaluation.asset_key.to_string())
                                          & (T.c.check_name == evaluation.check_name)
                                          & (T.c.run_id == RUNLESS_RUN_ID)
                                          & (T.c.partition == evaluation.partition)))
    except Exception:  # noqa: BLE001 - recording the demo never fails it
        pass
