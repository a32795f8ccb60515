"""One asset factory over the job registry: each job's tables as daily-partitioned assets whose
materialization is the job's bounded twin.

Materializing partitions of a job's tables (a partition backfill from the UI, or the daily
schedule) runs ``batch.backfill`` over their time window in one run (``BackfillPolicy.single_run``):
the same declaration and transform as the stream, with a perfect watermark. Before replacing the
range it compares what the stream wrote with the bounded result and reports that comparison as
the ``reconciliation`` check of each day partition. While the stream runs, its batches record
materializations of the same assets (``streams``).
"""

import warnings

import dagster as dg
from pydantic import Field
from dagster_pyspark import LazyPySparkResource

from streaming.declaration import Job
from streaming.errors import OwnershipError
from streaming.settings import Settings

from .resources import LakestreamResource
from .tables import table_key, table_spec

RECONCILIATION = "reconciliation"


class BoundedConfig(dg.Config):
    force: bool = Field(False, description="Backfill days whose windows a running stream may still write (without "
                        "it, such days are refused while the stream runs; a stopped stream's are backfilled): the "
                        "stream's later writes to them win.")


def _materialization_of(instance: dg.DagsterInstance, asset_key: dg.AssetKey, partition: str):
    """The newest materialization of a partition (the one this run just made), for a check to point at."""
    from dagster._core.definitions.asset_checks.asset_check_evaluation import (
        AssetCheckEvaluationTargetMaterializationData,
    )

    records = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=asset_key, asset_partitions=[partition]),
                                              limit=1).records
    if not records:
        return None
    mat = records[0]
    return AssetCheckEvaluationTargetMaterializationData(storage_id=mat.storage_id, run_id=mat.event_log_entry.run_id,
                                                         timestamp=mat.timestamp)


def reconciliation_evaluations(job: Job, report, partitions: list[str],
                               instance: dg.DagsterInstance | None = None) -> list[dg.AssetCheckEvaluation]:
    """One ``reconciliation`` evaluation per day partition of the run, from the comparison made before
    the replace (``report`` None: the stream never ran, nothing to compare), each pointing at the
    partition's materialization by this run."""
    key = table_key(job.sink)
    days = {d.day.isoformat(): d for d in report.days} if report is not None else {}
    out = []
    for partition in partitions:
        day = days.get(partition)
        if report is None:
            passed, description = True, f"{job.name} has never streamed: nothing to compare with the bounded twin"
            metadata = {}
        elif day is None:
            passed, description = True, "no output for the day, in the stream's tables or in the bounded twin"
            metadata = {"compared": 0, "unexplained": 0}
        else:
            passed = day.unexplained == 0
            description = (f"{day.unexplained:,} unexplained difference(s) between the stream and the bounded twin "
                           "(before the replace)" if day.unexplained else
                           f"{day.matching:,} of {day.compared:,} matching; every difference is explained by late data "
                           "or windows still in flight (compared before the replace)")
            metadata = {"compared": day.compared, "matching": day.matching, "late": day.late,
                        "in_flight": day.in_flight, "unexplained": day.unexplained,
                        "examples": dg.MetadataValue.md("\n".join(f"- `{e}`" for e in report.examples) or "none")}
        out.append(dg.AssetCheckEvaluation(
            asset_key=key, check_name=RECONCILIATION, partition=partition, passed=passed,
            severity=dg.AssetCheckSeverity.ERROR if not passed else dg.AssetCheckSeverity.WARN,
            description=description, metadata=metadata,
            target_materialization_data=_materialization_of(instance, key, partition) if instance else None,
        ))
    return out


def ownership_failure(job: Job, exc: OwnershipError) -> dg.Failure:
    """The refusal of a range the live stream still writes, as the launchpad's user can act on it."""
    return dg.Failure(
        description=f"{exc}. In Dagster: wait for the stream, pick earlier days, or launch again with the run "
                    f"config `ops: {{{job.name}_bounded: {{config: {{force: true}}}}}}` (the Launchpad's config "
                    "editor) to replace them anyway.",
        metadata={"refused_by": "the running stream owns these days", "fix": f"ops.{job.name}_bounded.config.force: true"},
        allow_retries=False,
    )


def bounded_assets(settings: Settings, job: Job, partitions_def) -> dg.AssetsDefinition:
    specs = [table_spec(settings, job, job.sink, "main", partitions_def),
             table_spec(settings, job, job.late_sink, "late", partitions_def)]
    with warnings.catch_warnings():  # (a partitioned check is a preview in Dagster 1.13: said once, not per job)
        warnings.simplefilter("ignore", dg.PreviewWarning)
        check = dg.AssetCheckSpec(
            RECONCILIATION, asset=table_key(job.sink), partitions_def=partitions_def,
            description="The stream's output for the day against its bounded recomputation, compared by each "
                        "materialization before it replaces the day; every difference must be explained by late "
                        "data or by windows still in flight. (On demand without replacing: `lakestream reconcile`.)")

    @dg.multi_asset(name=f"{job.name}_bounded", specs=specs, check_specs=[check], partitions_def=partitions_def,
                    backfill_policy=dg.BackfillPolicy.single_run(), op_tags={"kind": "spark"},
                    description=f"Bounded twin of {job.name}: recompute the chosen days and replace them in its tables.")
    def bounded(context: dg.AssetExecutionContext, config: BoundedConfig, lakestream: LakestreamResource,
                pyspark: LazyPySparkResource):
        from batch.backfill import backfill

        window = context.partition_time_window
        partitions = list(context.partition_keys)
        run_settings = lakestream.settings()
        declared = job
        spark = lakestream.spark(pyspark)
        try:
            report = backfill(spark, run_settings, declared, window.start, window.end, progress=context.log.info,
                              force=config.force, reconcile_first=True)
        except OwnershipError as exc:
            # The check says why it was not compared (rather than "execution failed"), then the run fails.
            for partition in partitions:
                yield dg.AssetCheckEvaluation(
                    asset_key=table_key(declared.sink), check_name=RECONCILIATION, partition=partition, passed=False,
                    severity=dg.AssetCheckSeverity.WARN,  # (a warning, not a green "passed": nothing was compared)
                    description="not compared this time: the backfill was refused because the live stream still "
                                "writes this day; its tables are unchanged (see the run's failure for the fix)")
            yield dg.Output(None, output_name=check.get_python_identifier())
            raise ownership_failure(declared, exc) from None
        s = report.stats
        common = {"range": f"{window.start.isoformat()} .. {window.end.isoformat()}", "days": report.partitions,
                  "seconds": round(report.seconds, 1), "lines_per_s": round(report.events_per_second)}
        yield dg.MaterializeResult(asset_key=table_key(declared.sink), metadata={
            **common, "dagster/row_count": s.rows_written, "rows_written": s.rows_written, "events": s.events,
            "quarantined": s.quarantined, "duplicates": s.duplicates})
        yield dg.MaterializeResult(asset_key=table_key(declared.late_sink), metadata={
            **common, "note": "nothing is late in a bounded run: the range's late rows are counted in the main table"})
        # The comparison was made before the replace: one evaluation per day, each linked to the day's new
        # materialization (events of this run, so running the same days again never collides).
        yield from reconciliation_evaluations(declared, report.reconciliation, partitions, context.instance)
        yield dg.Output(None, output_name=check.get_python_identifier())

    return bounded
