"""Dagster entry point (workspace.yaml): wires the job registry into assets, jobs and resources."""

from __future__ import annotations

import dagster as dg

from streaming.jobs import registry
from streaming.settings import Settings

from .assets import landing_specs, stream_assets
from .resources import LakestreamResource, pyspark_resource


def build_definitions(settings: Settings | None = None, home: str | None = None) -> dg.Definitions:
    jobs = registry().values()
    lakestream = LakestreamResource(home=home)
    settings = settings or lakestream.settings()
    streams = [stream_assets(job) for job in jobs]
    return dg.Definitions(
        assets=[*landing_specs(sorted({s.name for j in jobs for s in j.sources})), *streams],
        jobs=[dg.define_asset_job(f"{a.node_def.name}_stream", selection=dg.AssetSelection.assets(a)) for a in streams],
        resources={"lakestream": lakestream, "pyspark": pyspark_resource(settings)},
    )


@dg.definitions
def defs() -> dg.Definitions:
    return build_definitions()
