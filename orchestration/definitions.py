"""Dagster entry point (workspace.yaml): wires the job registry into assets, jobs, checks, sensors,
schedules and resources. A new job module needs no edit here."""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from streaming.project import current, registry
from streaming.settings import Settings

from .assets import bounded_assets
from .checks import job_checks, quarantine_check
from .dbt import dbt_definitions
from .resources import LakestreamResource, pyspark_resource
from .schedules import daily_backfill, savepoint_job, savepoint_schedule
from .sensors import health_sensor, supervisor_sensor
from .streams import stream_job, streams_job
from .tables import landing_assets, landing_sources, partitions, quarantine_spec, stream_spec


def build_definitions(settings: Settings | None = None, home: str | None = None,
                      config_file: str | None = None) -> dg.Definitions:
    lakestream = LakestreamResource(home=home, config_file=config_file)
    settings = settings or lakestream.settings()
    project = current(settings)
    jobs = list(registry(settings).values())  # resolved once (the deployment's overrides applied), passed on
    sources = list({s.name: s for j in jobs for s in j.sources}.values())
    days = partitions(settings)
    bounded = [bounded_assets(settings, j, days) for j in jobs]
    streams = [stream_job(j, days) for j in jobs] + [streams_job(jobs, days)]
    marts, dbt = dbt_definitions(settings, project.dbt_dir)
    savepoints = savepoint_job(jobs)
    backfill_job, backfill_schedule = daily_backfill(jobs, bounded, days)
    return dg.Definitions(
        assets=[*([landing_assets(landing_sources(jobs), jobs)] if landing_sources(jobs) else []),
                *[quarantine_spec(settings, s) for s in sources],
                *[stream_spec(j) for j in jobs], *bounded, *([marts] if marts else [])],
        asset_checks=[*[c for j in jobs for c in job_checks(j, days)], *[quarantine_check(s, jobs) for s in sources]],
        jobs=[*streams, savepoints, backfill_job,
              *([dg.define_asset_job("marts_build", selection=dg.AssetSelection.assets(marts),
                                     description="dbt build of the marts (models and their tests)")] if marts else [])],
        sensors=[health_sensor(jobs), supervisor_sensor(jobs, streams)],
        schedules=[savepoint_schedule(savepoints, settings.savepoint_schedule), backfill_schedule],
        resources={"lakestream": lakestream, "pyspark": pyspark_resource(settings, home, config_file),
                   **({"dbt": dbt} if dbt else {})},
    )


def definitions_for(config: str | Path, home: str | Path | None = None) -> dg.Definitions:
    """The Dagster definitions of the project a ``lakestream.yaml`` names, as a code location of its own (what
    ``lakestream new`` writes into ``definitions.py``): its settings are that file's, its lake home ``home``
    (default: ``.lake`` beside the file), and no LAKESTREAM_* variable reaches it, so several projects (the
    built-in example among them) sit side by side in one workspace, each with its assets, checks, sensors,
    schedules and lineage."""
    config = Path(config).expanduser().resolve()
    if not config.is_file():
        from streaming.errors import ConfigError

        raise ConfigError(f"{config} does not exist: definitions_for takes the project's lakestream.yaml")
    lake = str(Path(home).expanduser().resolve()) if home else None  # (else the file's home: key, or .lake beside it)
    if lake is None:
        import yaml

        named = (yaml.safe_load(config.read_text()) or {}).get("home")
        lake = str((config.parent / str(named or ".lake")).resolve())
    return build_definitions(home=lake, config_file=str(config))


@dg.definitions
def defs() -> dg.Definitions:
    return build_definitions()
