"""Exactly-once writes to Iceberg tables through Spark.

Every commit carries its ``Commit`` in the snapshot summary (``lakestream.commit``): DataFrame
writes through ``snapshot-property.*`` options, SQL statements (MERGE) through Iceberg's
``CommitMetadata.withCommitProperties``. A commit counts only if its snapshot is in the table's
*current* lineage, so commits that a savepoint restore rolled back are written again.

Range replacement is a metadata-only overwrite when the range is whole days (the tables are
partitioned by day), else a MERGE that also deletes the stale rows of the range.
"""

from __future__ import annotations

import itertools
import logging
from datetime import datetime, timezone
from typing import Mapping, Sequence

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from ...declaration import Table
from ...spark.jvm import expire_iceberg_snapshots, iceberg_current_snapshot, with_iceberg_commit_properties
from .base import COMMIT_KEY, OP, Commit, later_batch, with_retries

DAY_MS = 86_400_000
_views = itertools.count()


def _ts(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


def _sql_ts(ms: int) -> str:
    return "TIMESTAMP '" + _ts(ms).strftime("%Y-%m-%d %H:%M:%S.%f") + "'"


SMALL_WRITE_ROWS = 100_000  # rows one task writes unshuffled (Iceberg's fanout writer, a file per partition)


# Every Iceberg commit writes a new metadata file holding the table's whole snapshot list (~1.2 KB per
# snapshot of a lakestream table), and by default keeps every earlier one: a stream that commits its late
# table once a second would leave 3,600 metadata files an hour, their sizes growing with each (gigabytes
# within hours). Kept: the last few. Snapshots themselves are untouched: savepoints and the commit lookups of
# a replayed batch read them.
log = logging.getLogger(__name__)
METADATA_RETENTION = {"write.metadata.delete-after-commit.enabled": "true", "write.metadata.previous-versions-max": "20"}


class IcebergSink:
    format = "iceberg"

    def __init__(self, spark, table: Table):
        self.spark = spark
        self.table = table

    def location(self) -> str:
        return self.table.name

    def exists(self) -> bool:
        return bool(self.spark.catalog.tableExists(self.table.name))

    def ensure(self, schema: T.StructType, partition_column: str | None, comment: str = "",
               upserts: bool = False) -> None:
        """Create the table if missing. Tables a stream upserts into write merge-on-read: a correction
        adds a small delete file instead of rewriting the day's data files."""
        if self.exists():
            have = {f.name for f in self.spark.table(self.table.name).schema.fields}
            missing = [f for f in schema.fields if f.name not in have]
            if missing:  # a newer lakestream adds columns (nullable) to a table an older one created
                columns = ", ".join(f"`{f.name}` {f.dataType.simpleString()}" for f in missing)
                self.spark.sql(f"ALTER TABLE {self.table.name} ADD COLUMNS ({columns})")
            self._keep_few_metadata_files()
            return
        self.spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {self.table.namespace}")
        columns = ", ".join(f"`{f.name}` {f.dataType.simpleString()}" for f in schema.fields)
        partition = f"PARTITIONED BY (days(`{partition_column}`))" if partition_column else ""
        text = comment.replace("\\", "\\\\").replace("'", "\\'")
        props = {"format-version": "2", "write.distribution-mode": "hash", **METADATA_RETENTION}
        if upserts:
            props.update({f"write.{op}.mode": "merge-on-read" for op in ("merge", "update", "delete")})
        properties = ", ".join(f"'{k}'='{v}'" for k, v in props.items())
        self.spark.sql(
            f"CREATE TABLE IF NOT EXISTS {self.table.name} ({columns}) USING iceberg {partition} "
            f"COMMENT '{text}' TBLPROPERTIES ({properties})"
        )

    def _keep_few_metadata_files(self) -> None:
        """A table an older lakestream (or someone else) created keeps every metadata file it ever wrote: set
        :data:`METADATA_RETENTION` on it unless its owner chose otherwise."""
        key = "write.metadata.delete-after-commit.enabled"
        rows = self.spark.sql(f"SHOW TBLPROPERTIES {self.table.name} ('{key}')").collect()
        if rows and "does not have property" not in (rows[0]["value"] or ""):
            return  # set, either way
        properties = ", ".join(f"'{k}'='{v}'" for k, v in METADATA_RETENTION.items())
        try:
            self.spark.sql(f"ALTER TABLE {self.table.name} SET TBLPROPERTIES ({properties})")
        except Exception as exc:  # noqa: BLE001 - housekeeping: a catalog that refuses it must not stop the job
            log.warning("could not set %s on %s (%s): its earlier metadata files stay", ", ".join(METADATA_RETENTION),
                        self.table.name, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)

    # -- exactly-once --------------------------------------------------------------------
    def is_committed(self, commit: Commit) -> bool:
        name = self.table.name
        found = self.spark.sql(
            f"SELECT 1 FROM {name}.snapshots s JOIN {name}.history h ON s.snapshot_id = h.snapshot_id "
            f"WHERE h.is_current_ancestor AND s.summary['{COMMIT_KEY}'] = '{commit.id}' LIMIT 1"
        ).collect()
        return bool(found)

    def append(self, frame: DataFrame, commit: Commit, *, may_exist: bool = True, rows: int | None = None) -> bool:
        """``rows``: the frame's row count, when known. A small frame (a micro-batch's late rows or
        quarantined lines) is written by one task without the shuffle the table's hash distribution asks
        for: one Spark stage less on every batch, and the same files (one per day partition touched)."""
        if may_exist and self.is_committed(commit):
            return False
        small = rows is not None and rows <= SMALL_WRITE_ROWS

        def write() -> bool:
            writer = (frame.coalesce(1).writeTo(self.table.name).option("distribution-mode", "none")
                      .option("fanout-enabled", "true") if small else frame.writeTo(self.table.name))
            for key, value in commit.summary().items():
                writer = writer.option(f"snapshot-property.{key}", value)
            writer.append()
            return True

        return bool(with_retries(self.table, write, already=lambda: self.is_committed(commit)))

    def upsert(self, frame: DataFrame, keys: Sequence[str], commit: Commit, *, may_exist: bool = True) -> bool:
        if may_exist and self.is_committed(commit):
            return False
        columns = [c for c in frame.columns if c != OP]
        on = " AND ".join(f"t.`{k}` <=> s.`{k}`" for k in keys)
        sets = ", ".join(f"t.`{c}` = s.`{c}`" for c in columns)
        names = ", ".join(f"`{c}`" for c in columns)
        values = ", ".join(f"s.`{c}`" for c in columns)
        statement = (
            f"MERGE INTO {self.table.name} t USING {{view}} s ON {on} "
            f"WHEN MATCHED AND s.`{OP}` = 'delete' THEN DELETE "
            f"WHEN MATCHED THEN UPDATE SET {sets} "
            f"WHEN NOT MATCHED AND s.`{OP}` = 'upsert' THEN INSERT ({names}) VALUES ({values})"
        )
        return bool(with_retries(self.table, lambda: self._sql_with(frame, statement, commit.summary()) or True,
                                 already=lambda: self.is_committed(commit)))

    # -- bounded twins -------------------------------------------------------------------
    def replace_range(self, frame: DataFrame, column: str, lo_ms: int, hi_ms: int,
                      properties: Mapping[str, str]) -> None:
        props = {k: str(v) for k, v in properties.items()}
        if lo_ms % DAY_MS == 0 and hi_ms % DAY_MS == 0:
            def overwrite() -> None:
                # Validate against the snapshot this attempt starts from: a commit that lands in
                # between (the stream, another backfill) is a conflict, and the attempt is retried.
                writer = frame.writeTo(self.table.name).option("isolation-level", "serializable")
                base = self.version()
                if base is not None:
                    writer = writer.option("validate-from-snapshot-id", str(base))
                for key, value in props.items():
                    writer = writer.option(f"snapshot-property.{key}", value)
                writer.overwrite((F.col(column) >= F.lit(_ts(lo_ms))) & (F.col(column) < F.lit(_ts(hi_ms))))

            with_retries(self.table, overwrite)
            return
        # Not whole days: merge on every column, delete what the range no longer holds.
        on = " AND ".join(f"t.`{c}` <=> s.`{c}`" for c in frame.columns)
        statement = (
            f"MERGE INTO {self.table.name} t USING {{view}} s ON {on} "
            "WHEN NOT MATCHED THEN INSERT * "
            f"WHEN NOT MATCHED BY SOURCE AND t.`{column}` >= {_sql_ts(lo_ms)} AND t.`{column}` < {_sql_ts(hi_ms)} "
            "THEN DELETE"
        )
        with_retries(self.table, lambda: self._sql_with(frame, statement, props))

    def insert_missing(self, frame: DataFrame, on: Sequence[str], properties: Mapping[str, str]) -> None:
        condition = " AND ".join(f"t.`{c}` <=> s.`{c}`" for c in on)
        statement = f"MERGE INTO {self.table.name} t USING {{view}} s ON {condition} WHEN NOT MATCHED THEN INSERT *"
        with_retries(self.table, lambda: self._sql_with(frame, statement, {k: str(v) for k, v in properties.items()}))

    def delete_keys(self, frame: DataFrame, on: Sequence[str], properties: Mapping[str, str]) -> None:
        condition = " AND ".join(f"t.`{c}` <=> s.`{c}`" for c in on)
        statement = f"MERGE INTO {self.table.name} t USING {{view}} s ON {condition} WHEN MATCHED THEN DELETE"
        with_retries(self.table, lambda: self._sql_with(frame, statement, {k: str(v) for k, v in properties.items()}))

    # -- versions ------------------------------------------------------------------------
    def version(self) -> int | None:
        """The current snapshot id (None: no table, or no snapshot yet)."""
        if not self.exists():
            return None
        return iceberg_current_snapshot(self.spark, self.table.name)

    def version_before(self, app_id: str, batch_id: int, flush_kept: bool = False) -> int | None:
        """The snapshot that holds this table as the stream ``app_id`` left it after batch ``batch_id``: the parent
        of its first commit of a later batch in the current lineage, or the current snapshot when it has none
        (None: the table was empty then)."""
        if not self.exists():
            return None
        name = self.table.name
        rows = self.spark.sql(
            f"SELECT s.parent_id, s.summary['{COMMIT_KEY}'] AS c, h.made_current_at FROM {name}.snapshots s "
            f"JOIN {name}.history h ON s.snapshot_id = h.snapshot_id WHERE h.is_current_ancestor "
            f"AND s.summary['{COMMIT_KEY}'] LIKE '{app_id}%'"
        ).collect()
        later = sorted((r for r in rows if later_batch(r.c, app_id, batch_id, flush_kept)), key=lambda r: r.made_current_at)
        if not later:
            return self.version()
        return None if later[0].parent_id is None else int(later[0].parent_id)

    def has_version(self, version: int) -> bool:
        """Whether the table still holds snapshot ``version`` (not expired), so it can be restored."""
        if not self.exists():
            return False
        return bool(self.spark.sql(f"SELECT 1 FROM {self.table.name}.snapshots WHERE snapshot_id = {int(version)}").collect())

    def rollback(self, version: int | None) -> None:
        if not self.exists():
            return
        if version is None:
            self.spark.sql(f"DELETE FROM {self.table.name}")
        elif self.version() != version:
            self.spark.sql(
                f"CALL lake.system.set_current_snapshot(table => '{self.table.short}', snapshot_id => {int(version)})"
            )

    def read(self) -> DataFrame:
        return self.spark.table(self.table.name)

    def delete_where(self, condition: str) -> None:
        self.spark.sql(f"DELETE FROM {self.table.name} WHERE {condition}")

    def watermark_ms(self) -> int | None:
        """The watermark recorded with the table's newest stream commit (sink metadata)."""
        if not self.exists():
            return None
        row = self.spark.sql(
            f"SELECT summary['lakestream.watermark-ms'] AS w FROM {self.table.name}.snapshots "
            "WHERE summary['lakestream.watermark-ms'] IS NOT NULL ORDER BY committed_at DESC LIMIT 1"
        ).collect()
        return int(row[0].w) if row else None

    # -- snapshots ------------------------------------------------------------------------
    def expire(self, retention_ms: int) -> tuple[int, int]:
        """Expire snapshots older than the table's retention (``retention_ms`` unless the table sets its own);
        tagged ones stay. Returns the snapshots before and after."""
        if not self.exists():
            return 0, 0
        return with_retries(self.table, lambda: expire_iceberg_snapshots(self.spark, self.table.name, retention_ms))

    def tag(self, version: int, name: str) -> bool:
        """Keep snapshot ``version`` past expiry under tag ``name``; False when the table no longer has it."""
        if not self.has_version(version):
            return False
        self.spark.sql(f"ALTER TABLE {self.table.name} CREATE OR REPLACE TAG `{name}` AS OF VERSION {int(version)}")
        return True

    def untag(self, name: str) -> None:
        if self.exists():
            self.spark.sql(f"ALTER TABLE {self.table.name} DROP TAG IF EXISTS `{name}`")

    # -- SQL with commit properties ------------------------------------------------------
    def _sql_with(self, frame: DataFrame, statement: str, properties: Mapping[str, str]) -> None:
        """Run ``statement`` (with ``{view}`` bound to ``frame``) as one commit carrying ``properties``."""
        spark = frame.sparkSession
        view = f"lakestream_src_{next(_views)}"
        frame.createOrReplaceTempView(view)
        try:
            with_iceberg_commit_properties(spark, dict(properties), lambda: spark.sql(statement.format(view=view)))
        finally:
            spark.catalog.dropTempView(view)
