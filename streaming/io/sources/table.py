"""An append-only Iceberg table of the ``lake`` catalog as a source (typically another job's output:
bronze -> silver -> gold). The stream follows the table's appended snapshots (Spark's Iceberg streaming
read; replacements and deletes, e.g. an upstream backfill, are not re-read: the downstream's bounded twin
picks them up); a bounded read takes the table as of a snapshot. Each row becomes a JSON object of the
declared fields (``source_file``: its data file), checked like any other format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ...errors import ConfigError, DeclarationError
from ..parse import ARRIVAL, PROBLEM
from .base import NO_ARRIVAL, SOURCE, SourceKind


class IcebergTable(SourceKind):
    name = "table"

    def check(self, source) -> None:
        if not source.location:
            raise DeclarationError(f"Source {source.name}: a table source names its table, e.g. "
                                   f"location='lake.silver.{source.name}'")

    def location(self, settings, source) -> str:
        return source.location

    def upstream_table(self, source) -> str | None:
        return source.location

    # -- reading --------------------------------------------------------------------------------
    def stream(self, spark, settings, source, *, max_files_per_trigger: int | None) -> DataFrame:
        check_table(spark, source)
        reader = (spark.readStream.format("iceberg")
                  .option("streaming-skip-delete-snapshots", "true")
                  .option("streaming-skip-overwrite-snapshots", "true"))
        if max_files_per_trigger is not None:
            reader = reader.option("streaming-max-files-per-micro-batch", max_files_per_trigger)
        return _records(reader.load(source.location), source)

    def read(self, spark, settings, source, *, position: int | None = None,
             files: list[str] | None = None) -> DataFrame:
        check_table(spark, source)
        reader = spark.read.format("iceberg")
        if position is not None:
            reader = reader.option("snapshot-id", int(position))
        return _records(reader.load(source.location), source)

    def paced_under_available_now(self, max_files_per_trigger: int | None) -> bool:
        # Iceberg's stream (1.10) ignores read limits under availableNow and reads everything in one batch.
        return max_files_per_trigger is not None

    # -- position -------------------------------------------------------------------------------
    def position(self, offset: Any) -> int | None:
        """The snapshot an Iceberg streaming offset (``{"snapshot_id": ..., "position": ...}``) has read up to."""
        if isinstance(offset, dict) and offset.get("snapshot_id") is not None:
            return int(offset["snapshot_id"])
        return None

    def describe_position(self, position: int) -> str:
        return f"snapshot {position}"

    # -- tests ----------------------------------------------------------------------------------
    def land(self, spark, settings, source, records: Any, name: str, *, empty: bool = False,
             mtime: float | None = None) -> list[Path]:
        """Append ``records`` (dicts or a pandas DataFrame) to the table as one snapshot. The table is created
        with the declared types if missing; create it yourself with looser types (e.g. strings) to feed
        values that break the declaration."""
        import pandas as pd

        from ..parse import spark_type

        if records is None or len(records) == 0:
            return []
        if not spark.catalog.tableExists(source.location):
            spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {source.location.rsplit('.', 1)[0]}")
            columns = ", ".join(f"`{f.name}` {spark_type(f).simpleString()}" for f in source.fields
                                if not (source.dedup_from and f.name == source.dedup_key))
            spark.sql(f"CREATE TABLE {source.location} ({columns}) USING iceberg")
        schema = spark.table(source.location).schema
        frame = records if isinstance(records, pd.DataFrame) else pd.DataFrame(list(records))
        text = [[None if _missing(v) else (v.isoformat() if hasattr(v, "isoformat") else str(v))
                 for v in (row.get(f.name) for f in schema.fields)] for row in frame.to_dict("records")]
        rows = spark.createDataFrame(text, ", ".join(f"`{f.name}` string" for f in schema.fields))
        rows.select(*[F.col(f.name).cast(f.dataType).alias(f.name) for f in schema.fields]).writeTo(source.location).append()
        return []

    def reset(self, spark, source) -> None:
        spark.sql(f"DROP TABLE IF EXISTS {source.location} PURGE")


KIND = IcebergTable()


def check_table(spark, source) -> None:
    """Refuse, in one line, a table source whose table is missing or is not append-only."""
    table = source.location
    if not spark.catalog.tableExists(table):
        raise ConfigError(f"source {source.name} reads table {table}, which does not exist yet: run the job that "
                          f"writes it first (table sources read Iceberg tables of the 'lake' catalog)")
    props = {r.key: r.value for r in spark.sql(f"SHOW TBLPROPERTIES {table}").collect()}
    if props.get("write.merge.mode") == "merge-on-read":  # lakestream's upserted tables (see IcebergSink.ensure)
        raise ConfigError(f"source {source.name} reads {table}, which its job upserts (allowed lateness or sessions): "
                          f"a table source must be append-only; read that job's late table or set its lateness to 0")


def _records(frame: DataFrame, source) -> DataFrame:
    present = set(frame.columns)
    built = source.dedup_key if source.dedup_from else None
    members = [F.col(f.name) for f in source.fields if f.name in present and f.name != built]
    if source.dedup_from:
        members.append(F.concat_ws("|", *[F.col(c).cast("string") for c in source.dedup_from if c in present])
                       .alias(source.dedup_key))
    return frame.select(F.to_json(F.struct(*members)).alias("value"), F.input_file_name().alias("source_file"),
                        F.lit(source.name).alias(SOURCE), F.lit(NO_ARRIVAL).cast("long").alias(ARRIVAL),
                        F.lit(None).cast("string").alias(PROBLEM))


def _missing(value) -> bool:
    import pandas as pd

    return value is None or (isinstance(value, float) and value != value) or value is pd.NaT
