"""The dbt project (``dbt/``) as Dagster assets, via dagster-dbt.

* The profile is generated from the lakestream settings: dbt-spark's ``session`` method with the
  jobs' own Spark configuration (Iceberg runtime jar, catalog ``lake`` as the default catalog),
  so the marts read the job tables and are written as Iceberg tables in ``lake.marts``.
* dbt sources are mapped onto the job tables' asset keys (``lake/<domain>/<table>``), so the
  lineage graph runs landing -> job table -> mart; dbt tests become asset checks.
* The manifest is parsed once (``make install`` does it, else the first definitions load), never
  at import time.
"""


import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import dagster as dg
import yaml
from dagster_dbt import DagsterDbtTranslator, DbtCliResource, DbtProject, dbt_assets

from streaming.errors import ConfigError
from streaming.spark.session import spark_conf
from streaming.settings import Settings

DBT_DIR = Path(__file__).resolve().parents[1] / "dbt"  # the built-in example project's dbt project
DBT = Path(sys.executable).with_name("dbt")


def write_profiles(settings: Settings) -> Path:
    """``$LAKESTREAM_HOME/dbt/profiles.yml`` for these settings (rewritten only when it changes)."""
    conf = {**spark_conf(settings), "spark.sql.defaultCatalog": "lake",
            "spark.sql.catalogImplementation": "in-memory", "spark.app.name": "lakestream-dbt"}
    profile = {"lakestream": {"target": "lake", "outputs": {"lake": {
        "type": "spark", "method": "session", "host": "NA", "schema": "marts", "threads": 1,
        "server_side_parameters": conf}}}}
    folder = Path(settings.home) / "dbt"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / "profiles.yml"
    text = yaml.safe_dump(profile, sort_keys=True)
    # The profile holds the whole Spark configuration, catalog credentials included: readable by its owner only.
    if not path.exists() or path.read_text() != text or path.stat().st_mode & 0o077:
        tmp = folder / f".profiles.yml.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.chmod(tmp, 0o600)  # (whatever the umask)
        os.replace(tmp, path)
    os.chmod(folder, 0o700)
    return folder


@lru_cache(maxsize=4)
def dbt_project(profiles: Path, project_dir: Path = DBT_DIR) -> DbtProject:
    return DbtProject(project_dir=project_dir, target_path=project_dir / "target", profiles_dir=profiles)


def ensure_manifest(project: DbtProject) -> Path:
    """The project's manifest, parsed once (``dbt parse`` needs no Spark)."""
    if not project.manifest_path.exists():
        result = subprocess.run(
            [str(DBT), "parse", "--project-dir", str(project.project_dir), "--profiles-dir", str(project.profiles_dir),
             "--target-path", str(project.target_path), "--quiet"],
            capture_output=True, text=True, timeout=300,
        )
        if result.returncode != 0 or not project.manifest_path.exists():
            last = (result.stdout + result.stderr).strip().splitlines()[-1:] or ["no output"]
            raise ConfigError(f"dbt parse of {project.project_dir} failed: {last[0]}; run `make install` (dbt-core, dbt-spark)")
    return project.manifest_path


class LakeTranslator(DagsterDbtTranslator):
    """dbt sources are the job tables (``lake/<schema>/<table>``); models live in ``lake/marts``."""

    def get_asset_spec(self, manifest, unique_id, project):
        spec = super().get_asset_spec(manifest, unique_id, project)
        node = manifest.get("sources", {}).get(unique_id) or manifest["nodes"].get(unique_id, {})
        kind = node.get("resource_type")
        if kind == "source":
            return spec.replace_attributes(key=dg.AssetKey(["lake", node["schema"], node["name"]]))
        if kind in ("model", "seed", "snapshot"):
            return spec.replace_attributes(key=dg.AssetKey(["lake", "marts", node["name"]]), group_name="marts",
                                           owners=["team:analytics"])
        return spec


class LakeDbt(DbtCliResource):
    """dbt over the lake's tables (dbt-spark, session method): builds the project's marts. Nothing to set here."""


def dbt_definitions(settings: Settings, project_dir: Path | None = DBT_DIR) -> tuple[dg.AssetsDefinition | None, DbtCliResource | None]:
    """The marts of the project's dbt folder (its profile must be ``lakestream``), or ``(None, None)``."""
    if project_dir is None:
        return None, None
    project = dbt_project(write_profiles(settings), Path(project_dir))
    manifest = ensure_manifest(project)

    @dbt_assets(manifest=manifest, project=project, dagster_dbt_translator=LakeTranslator(), name="lake_marts")
    def lake_marts(context: dg.AssetExecutionContext, dbt: DbtCliResource):
        yield from dbt.cli(["build"], context=context).stream()

    # (dagster-dbt's own class documents every option at length, and the launchpad of every job showed it)
    return lake_marts, LakeDbt(project_dir=project, dbt_executable=str(DBT))
