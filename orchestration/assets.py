"""One asset factory: a job declaration -> the Dagster assets of its stream.

The landing folder is an external asset upstream of the job's tables, so lineage reads
landing/payments -> lake/payments/purchase_metrics (+ its late side output).
"""

import dagster as dg
from dagster_pyspark import LazyPySparkResource

from streaming.declaration import Job, Table
from streaming.durations import parse_duration
from streaming.jobs import get_job
from streaming.runner import describe_watermark, run_stream

from .resources import LakestreamResource


def table_key(table: Table) -> dg.AssetKey:
    return dg.AssetKey(table.name.split("."))


def landing_key(source: str) -> dg.AssetKey:
    return dg.AssetKey(["landing", source])


def landing_specs(sources: list[str]) -> list[dg.AssetSpec]:
    return [
        dg.AssetSpec(
            landing_key(name),
            description=f"JSON-lines files of {name} events, filled in arrival order ($LAKESTREAM_HOME/landing/{name}).",
            group_name="landing",
            kinds={"json"},
        )
        for name in sources
    ]


class StreamConfig(dg.Config):
    """How to run the stream: consume what is there and stop, or keep running until terminated."""

    mode: str = "available_now"  # "available_now" (consume what exists, stop) | "continuous"
    trigger_interval: str = "5s"


def stream_assets(job: Job) -> dg.AssetsDefinition:
    domain = job.sink.namespace.split(".")[1]
    specs = [
        dg.AssetSpec(
            table_key(job.sink),
            deps=[landing_key(s.name) for s in job.sources],
            description=job.description,
            group_name=domain,
            owners=[f"team:{job.owner}"],
            kinds={"iceberg", "spark"},
            metadata={"keys": ", ".join(job.keys), "table": job.sink.name},
        ),
        dg.AssetSpec(
            table_key(job.late_sink),
            deps=[landing_key(s.name) for s in job.sources],
            description=f"Late side output of {job.name}: events that arrived after their window closed.",
            group_name=domain,
            kinds={"iceberg"},
        ),
    ]

    @dg.multi_asset(name=job.name, specs=specs, description=f"Run {job.name} as a stream.")
    def _stream(context: dg.AssetExecutionContext, config: StreamConfig, lakestream: LakestreamResource,
                pyspark: LazyPySparkResource):
        if config.mode not in ("available_now", "continuous"):
            raise dg.Failure(f"mode must be 'available_now' or 'continuous', got {config.mode!r}")
        settings = lakestream.settings().with_job(
            job.name, trigger_interval=parse_duration(config.trigger_interval, field="trigger_interval")
        )
        declared = get_job(job.name, settings)
        spark = lakestream.spark(pyspark)
        report = run_stream(
            spark, settings, declared, available_now=config.mode == "available_now",
            progress=lambda r: context.log.info(
                f"batch {r.batch_id}: {r.stats.lines} lines, {r.stats.late} late, {r.stats.quarantined} quarantined, "
                f"{r.stats.rows_written} rows; watermark {describe_watermark(r.stats.watermark_out_ms)}"
            ),
            install_signal_handlers=False,
        )
        s = report.stats
        watermark = describe_watermark(report.totals.watermark_out_ms if report.totals else None)
        yield dg.MaterializeResult(
            asset_key=table_key(job.sink),
            metadata={
                "batches": report.batches, "lines": s.lines, "events": s.events, "late": s.late,
                "quarantined": s.quarantined, "rows_written": s.rows_written, "watermark": watermark,
            },
        )
        yield dg.MaterializeResult(asset_key=table_key(job.late_sink), metadata={"late_rows_added": s.late})

    return _stream
