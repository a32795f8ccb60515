"""One asset factory over the job registry: each job's tables as daily-partitioned assets whose
materialization is the job's bounded twin.

Materializing partitions of a job's tables (a partition backfill from the UI, or the daily
schedule) runs ``batch.backfill`` over their time window in one run (``BackfillPolicy.single_run``):
the same declaration and transform as the stream, with a perfect watermark. Before replacing the
range it compares what the stream wrote with the bounded result and reports that comparison as
the ``reconciliation`` check of each day partition. While the stream runs, its batches record
materializations of the same assets (``streams``).
"""


import dagster as dg
from dagster_pyspark import LazyPySparkResource

from streaming.declaration import Job
from streaming.jobs import get_job
from streaming.settings import Settings

from .resources import LakestreamResource
from .tables import table_key, table_spec

RECONCILIATION = "reconciliation"


class BoundedConfig(dg.Config):
    force: bool = False  # also replace windows the live stream may still write (see lakestream backfill --force)


def reconciliation_evaluations(job: Job, report) -> list[dg.AssetCheckEvaluation]:
    """One check evaluation per day partition of a reconciliation report."""
    return [
        dg.AssetCheckEvaluation(
            asset_key=table_key(job.sink), check_name=RECONCILIATION, partition=day.day.isoformat(),
            passed=day.unexplained == 0,
            severity=dg.AssetCheckSeverity.ERROR,
            description=f"{day.unexplained} unexplained difference(s) between the stream and the bounded twin"
            if day.unexplained else "every difference is explained by late data or windows still in flight",
            metadata={"compared": day.compared, "matching": day.matching, "late": day.late,
                      "in_flight": day.in_flight, "unexplained": day.unexplained,
                      "examples": "\n".join(report.examples) or "-"},
        )
        for day in report.days
    ]


def bounded_assets(settings: Settings, job: Job, partitions_def) -> dg.AssetsDefinition:
    specs = [table_spec(settings, job, job.sink, "main", partitions_def),
             table_spec(settings, job, job.late_sink, "late", partitions_def)]

    @dg.multi_asset(name=f"{job.name}_bounded", specs=specs, partitions_def=partitions_def,
                    backfill_policy=dg.BackfillPolicy.single_run(), op_tags={"kind": "spark"},
                    description=f"Bounded twin of {job.name}: recompute the chosen days and replace them in its tables.")
    def bounded(context: dg.AssetExecutionContext, config: BoundedConfig, lakestream: LakestreamResource,
                pyspark: LazyPySparkResource):
        from batch.backfill import backfill

        window = context.partition_time_window
        run_settings = lakestream.settings()
        declared = get_job(job.name, run_settings)
        spark = lakestream.spark(pyspark)
        report = backfill(spark, run_settings, declared, window.start, window.end, progress=context.log.info,
                          force=config.force, reconcile_first=True)
        if report.reconciliation is not None:
            for evaluation in reconciliation_evaluations(declared, report.reconciliation):
                context.instance.report_runless_asset_event(evaluation)
        s = report.stats
        common = {"range": f"{window.start.isoformat()} .. {window.end.isoformat()}", "days": report.partitions,
                  "seconds": round(report.seconds, 1), "lines_per_s": round(report.events_per_second)}
        yield dg.MaterializeResult(asset_key=table_key(declared.sink), metadata={
            **common, "rows_written": s.rows_written, "events": s.events, "quarantined": s.quarantined,
            "duplicates": s.duplicates})
        yield dg.MaterializeResult(asset_key=table_key(declared.late_sink), metadata={
            **common, "note": "nothing is late in a bounded run: the range's late rows are counted in the main table"})

    return bounded
