"""Schedules: a savepoint of every running stream before a deploy, and yesterday's backfills.

* ``savepoint_before_deploy`` (a job, launchable on demand, and a schedule): for each stream that
  should be running, marks it *paused* (so the supervisor leaves it alone), takes a
  stop-with-savepoint, records the savepoint id in the run's tags and metadata, and marks it
  *running from that savepoint*: the ``stream_supervisor`` relaunches it from there, so new code
  starts from consistent state.
* ``daily_backfill``: yesterday's day partition of every job's tables, recomputed by the bounded
  twins (each reporting the stream-vs-bounded reconciliation before replacing), then the
  partition's ``reconciliation`` checks.
"""


from datetime import timedelta

import dagster as dg
from dagster_pyspark import LazyPySparkResource

from streaming.declaration import Job

from .assets import RECONCILIATION
from .resources import LakestreamResource
from .streams import DesiredState
from .tables import table_key


def savepoint_job(jobs: list[Job]) -> dg.JobDefinition:
    @dg.op(name="take_savepoints", description="Stop every running stream with a savepoint and mark it to resume from it.")
    def take_savepoints(context: dg.OpExecutionContext, lakestream: LakestreamResource, pyspark: LazyPySparkResource):
        from streaming.checkpoint.savepoints import Savepoints

        settings = lakestream.settings()
        by_name = {job.name: job for job in jobs}
        # Every stream that should run is paused first (so the supervisor leaves them all alone, and
        # an application is not restarted between the savepoints of two of its jobs), then each is
        # stopped with a savepoint, then all are marked to resume from their savepoints.
        paused = {}
        for job in jobs:
            desired = DesiredState(context.instance, job.name)
            wanted = desired.get()
            if wanted.get("state") == "running":
                paused[job.name] = {k: v for k, v in wanted.items() if k not in ("state", "updated_ms", "reason")}
                desired.set("paused", **{**paused[job.name], "reason": "savepoint-before-deploy"})
        taken = {}
        try:
            spark = lakestream.spark(pyspark) if paused else None
            for name in paused:
                savepoint = Savepoints(spark, settings, progress=context.log.info).create(by_name[name])
                taken[name] = savepoint.id
                context.log.info(f"{name}: savepoint {savepoint.id}")
        finally:  # resume every paused stream; from its savepoint when one was taken
            for name, wanted in paused.items():
                extra = {"from_savepoint": taken[name]} if name in taken else {}
                DesiredState(context.instance, name).set("running", **{**wanted, **extra})
        if taken:
            context.log.info(f"the supervisor resumes {', '.join(taken)} from their savepoints")
            context.instance.add_run_tags(context.run_id, {f"lakestream/savepoint.{k}": v for k, v in taken.items()})
        yield dg.Output(None, metadata={name: savepoint for name, savepoint in taken.items()} or {"streams": "none running"})

    @dg.job(name="savepoint_before_deploy", description=take_savepoints.description)
    def savepoint_before_deploy():
        take_savepoints()

    return savepoint_before_deploy


IN_FLIGHT = (dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED)  # (a run whose
# process died is failed by the instance's run monitoring: `make ui`'s dagster.yaml turns it on)


def savepoint_schedule(job: dg.JobDefinition, cron: str = "0 4 * * *") -> dg.ScheduleDefinition:
    @dg.schedule(name="savepoint_before_deploy_schedule", job=job, cron_schedule=cron, execution_timezone="UTC",
                 default_status=dg.DefaultScheduleStatus.STOPPED,
                 description="Savepoints of every running stream at a fixed time (deploys follow it); a tick while "
                             "a savepoint run is still queued or running takes none.")
    def savepoint_before_deploy_schedule(context: dg.ScheduleEvaluationContext):
        # A tick while another savepoint run is under way (launched by hand, or a slow one past the next tick)
        # would pause streams that one has paused and stop the stream it resumes: it is skipped, saying why.
        running = context.instance.get_runs(dg.RunsFilter(job_name=job.name, statuses=list(IN_FLIGHT)), limit=1)
        if running:
            return dg.SkipReason(f"savepoint_before_deploy run {running[0].run_id} is still "
                                 f"{running[0].status.value.lower()}: this tick takes no savepoint (the next one may)")
        return dg.RunRequest()

    return savepoint_before_deploy_schedule


def daily_backfill(jobs: list[Job], bounded: list[dg.AssetsDefinition], partitions_def):
    selection = dg.AssetSelection.assets(*bounded).without_checks() | dg.AssetSelection.checks(
        *[dg.AssetCheckKey(table_key(j.sink), RECONCILIATION) for j in jobs])
    job = dg.define_asset_job("daily_backfill", selection=selection, partitions_def=partitions_def,
                              description="Recompute a day of every job with its bounded twin, then reconcile it.")

    @dg.schedule(name="daily_backfill_schedule", job=job, cron_schedule="30 1 * * *", execution_timezone="UTC",
                 default_status=dg.DefaultScheduleStatus.STOPPED,
                 description="At 01:30 UTC, backfill and reconcile yesterday's partition of every job.")
    def daily_backfill_schedule(context: dg.ScheduleEvaluationContext):
        # (Not build_schedule_from_partitioned_job: the partitions reach today, end_offset=1, so it would ask
        # for today's still-growing day. Dagster 1.13 lists every schedule's "Partition set" as None; each
        # run carries its partition key.)
        day = (context.scheduled_execution_time - timedelta(days=1)).date().isoformat()
        return dg.RunRequest(run_key=f"daily_backfill:{day}", partition_key=day)

    return job, daily_backfill_schedule
