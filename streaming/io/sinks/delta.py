"""Exactly-once writes to Delta Lake tables.

``DeltaRsSink`` (the default: Delta's Spark jars come only from Maven) commits with delta-rs from
the driver: the batch's rows are collected as Arrow (sink outputs are windows, alerts, late and
quarantined events: small next to the input) and every commit carries an application
transaction ``(app_id, batch id)``, Delta's own idempotent-writer marker, plus the commit id and
watermark as commit metadata. A replayed batch whose transaction version is already recorded is
skipped.

``DeltaSparkSink`` writes the same tables through Spark's native Delta source (``txnAppId`` /
``txnVersion``) when delta-spark's jars are on the classpath and ``delta.engine: spark`` is set.

Delta tables live under ``delta_root`` as ``<namespace>/<table>``, partitioned by day like their
Iceberg twins. Delta has no hidden partitioning, so a table whose partition column is a timestamp
gets a generated column ``<column>_day = CAST(<column> AS DATE)`` (Delta's generated columns,
filled in by delta-rs and delta-spark alike; writers never supply it, ``read`` leaves it out). Range
replacement is a predicate overwrite, atomic like every Delta commit, and touches only the files
of the days it covers.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Mapping, Sequence

import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import types as T
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

from ...declaration import Table
from ...spark.jvm import collect_arrow
from .base import COMMIT_KEY, OP, WATERMARK_KEY, Commit, later_batch, with_retries


GENERATED = "delta.generationExpression"  # field metadata key of Delta's generated columns


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def to_arrow(frame: DataFrame) -> pa.Table:
    """Collect a (small) Spark frame to the driver as an Arrow table with the frame's schema."""
    schema = to_arrow_schema(frame.schema)
    batches = collect_arrow(frame)
    if not batches:
        return schema.empty_table()
    return pa.Table.from_batches(batches).cast(schema)


class DeltaRsSink:
    format = "delta"

    def __init__(self, spark, table: Table, root: str, storage_options: Mapping[str, str] | None = None):
        self.spark = spark
        self.table = table
        self.uri = f"{root.rstrip('/')}/{table.domain}/{table.name.split('.')[2]}"
        self.options = dict(storage_options or {}) or None

    def location(self) -> str:
        return self.uri

    def _dt(self):
        from deltalake import DeltaTable

        return DeltaTable(self.uri, storage_options=self.options)

    def exists(self) -> bool:
        from deltalake import DeltaTable

        return DeltaTable.is_deltatable(self.uri, storage_options=self.options)

    def ensure(self, schema: T.StructType, partition_column: str | None, comment: str = "",
               upserts: bool = False) -> None:
        from deltalake import DeltaTable

        if self.exists():
            from deltalake import Field as DeltaField, Schema as DeltaSchema

            table = self._dt()
            have = {f.name for f in table.schema().fields}
            missing = [f for f in schema.fields if f.name not in have]
            if missing:  # a newer lakestream adds columns (nullable) to a table an older one created
                fields = DeltaSchema.from_arrow(to_arrow_schema(T.StructType(missing))).fields
                table.alter.add_columns([DeltaField(f.name, f.type, nullable=True) for f in fields])
            return
        arrow = to_arrow_schema(schema)
        partition_by = None
        if partition_column is not None:
            if isinstance(schema[partition_column].dataType, T.DateType):
                partition_by = [partition_column]
            else:
                day = f"{partition_column}_day"
                arrow = arrow.append(pa.field(day, pa.date32(), metadata={GENERATED: f"CAST({partition_column} AS DATE)"}))
                partition_by = [day]
        DeltaTable.create(self.uri, schema=arrow, mode="ignore", name=self.table.short, partition_by=partition_by,
                          description=comment or None, storage_options=self.options)

    def _properties(self, commit: Commit | None, properties: Mapping[str, str] | None = None):
        from deltalake import CommitProperties, Transaction

        if commit is None:
            return CommitProperties(custom_metadata={k: str(v) for k, v in (properties or {}).items()})
        return CommitProperties(custom_metadata=commit.summary(),
                                app_transactions=[Transaction(commit.app_id, commit.version)])

    # -- exactly-once --------------------------------------------------------------------
    def is_committed(self, commit: Commit) -> bool:
        recorded = self._dt().transaction_version(commit.app_id)
        return recorded is not None and recorded >= commit.version

    def append(self, frame: DataFrame, commit: Commit, *, may_exist: bool = True, rows: int | None = None) -> bool:
        from deltalake import write_deltalake

        if may_exist and self.is_committed(commit):
            return False
        data = to_arrow(frame)
        with_retries(self.table, lambda: write_deltalake(self.uri, data, mode="append", storage_options=self.options,
                                                         commit_properties=self._properties(commit)),
                     already=lambda: self.is_committed(commit))
        return True

    def upsert(self, frame: DataFrame, keys: Sequence[str], commit: Commit, *, may_exist: bool = True) -> bool:
        if may_exist and self.is_committed(commit):
            return False
        data = to_arrow(frame)
        columns = {c: f"s.{c}" for c in frame.columns if c != OP}
        on = " AND ".join(f"(t.{k} IS NOT DISTINCT FROM s.{k})" for k in keys)

        def merge() -> None:
            (self._dt().merge(data, on, source_alias="s", target_alias="t", commit_properties=self._properties(commit))
             .when_matched_delete(predicate=f"s.{OP} = 'delete'")
             .when_matched_update(updates=columns, predicate=f"s.{OP} = 'upsert'")
             .when_not_matched_insert(updates=columns, predicate=f"s.{OP} = 'upsert'")
             .execute())

        with_retries(self.table, merge, already=lambda: self.is_committed(commit))
        return True

    # -- bounded twins -------------------------------------------------------------------
    def replace_range(self, frame: DataFrame, column: str, lo_ms: int, hi_ms: int,
                      properties: Mapping[str, str]) -> None:
        from deltalake import write_deltalake

        data = to_arrow(frame)
        predicate = f"{column} >= '{_iso(lo_ms)}' AND {column} < '{_iso(hi_ms)}'"
        with_retries(self.table, lambda: write_deltalake(
            self.uri, data, mode="overwrite", predicate=predicate, storage_options=self.options,
            commit_properties=self._properties(None, properties)))

    def insert_missing(self, frame: DataFrame, on: Sequence[str], properties: Mapping[str, str]) -> None:
        data = to_arrow(frame)
        if data.num_rows == 0:
            return
        condition = " AND ".join(f"(t.{c} IS NOT DISTINCT FROM s.{c})" for c in on)
        with_retries(self.table, lambda: self._dt().merge(
            data, condition, source_alias="s", target_alias="t", commit_properties=self._properties(None, properties)
        ).when_not_matched_insert_all().execute())

    def delete_keys(self, frame: DataFrame, on: Sequence[str], properties: Mapping[str, str]) -> None:
        data = to_arrow(frame.select(*on))
        if data.num_rows == 0:
            return
        condition = " AND ".join(f"(t.{c} IS NOT DISTINCT FROM s.{c})" for c in on)
        with_retries(self.table, lambda: self._dt().merge(
            data, condition, source_alias="s", target_alias="t", commit_properties=self._properties(None, properties)
        ).when_matched_delete().execute())

    # -- versions ------------------------------------------------------------------------
    def version(self) -> int | None:
        return self._dt().version() if self.exists() else None

    def version_before(self, app_id: str, batch_id: int) -> int | None:
        """The version that holds this table as the stream ``app_id`` left it after batch ``batch_id``: the one
        before its first commit of a later batch, or the current version when it has none."""
        if not self.exists():
            return None
        later = [h["version"] for h in self._dt().history() if later_batch(h.get(COMMIT_KEY), app_id, batch_id)]
        return min(later) - 1 if later else self.version()

    def has_version(self, version: int) -> bool:
        """Whether version ``version`` can still be loaded (its log and files not cleaned up)."""
        from deltalake import DeltaTable

        if not self.exists():
            return False
        try:
            DeltaTable(self.uri, version=int(version), storage_options=self.options)
        except Exception:  # noqa: BLE001 - delta-rs raises several kinds for a version it cannot load
            return False
        return True

    def rollback(self, version: int | None) -> None:
        if not self.exists():
            return
        table = self._dt()
        if version is None:
            table.delete()
        elif table.version() != version:
            table.restore(version)

    def read(self) -> DataFrame:
        table = self._dt()
        arrow = pa.schema(table.schema().to_arrow())  # delta-rs hands out arro3 schemas
        schema = from_arrow_schema(pa.schema([f for f in arrow if GENERATED.encode() not in (f.metadata or {})]))
        files = table.file_uris()
        if not files:
            return self.spark.createDataFrame([], schema)
        return self.spark.read.schema(schema).parquet(*files)

    def delete_where(self, condition: str) -> None:
        self._dt().delete(condition)

    def watermark_ms(self) -> int | None:
        if not self.exists():
            return None
        for entry in self._dt().history(50):
            if WATERMARK_KEY in entry:
                return int(entry[WATERMARK_KEY])
        return None


class DeltaSparkSink(DeltaRsSink):
    """Bulk writes (appends, range replacement) of the same Delta tables through delta-spark, so
    large outputs never pass through the driver; merges and versions stay with delta-rs.
    Needs delta-spark's jars on the classpath (not exercised here: they come only from Maven)."""

    def append(self, frame: DataFrame, commit: Commit, *, may_exist: bool = True, rows: int | None = None) -> bool:
        if may_exist and self.is_committed(commit):
            return False
        writer = (frame.write.format("delta").mode("append").option("txnAppId", commit.app_id)
                  .option("txnVersion", commit.version).option("userMetadata", commit.id))
        with_retries(self.table, lambda: writer.save(self.uri))
        return True

    def replace_range(self, frame: DataFrame, column: str, lo_ms: int, hi_ms: int,
                      properties: Mapping[str, str]) -> None:
        condition = f"{column} >= '{_iso(lo_ms)}' AND {column} < '{_iso(hi_ms)}'"
        with_retries(self.table, lambda: frame.write.format("delta").mode("overwrite")
                     .option("replaceWhere", condition).save(self.uri))
