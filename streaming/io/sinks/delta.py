"""Exactly-once writes to Delta Lake tables.

``DeltaRsSink`` (the default: Delta's Spark jars come only from Maven) commits with delta-rs, and
every commit carries an application transaction ``(app_id, batch id)``, Delta's own idempotent-writer
marker, plus the commit id and watermark as commit metadata. A replayed batch whose transaction
version is already recorded is skipped.

Where the rows go through:

* bulk writes (a backfill's range replacement, an append of many or of uncounted rows): the executors
  write the Parquet data files into the table's folder (``lakestream-<uuid>/<partition>=<day>/...``,
  Spark's own writer), the driver lists them and commits their add actions with delta-rs
  (``create_write_transaction``): no row passes through the driver, whose memory then bounds nothing;
* small writes (a micro-batch's windows, late rows or quarantined lines, counted before writing) are
  collected as Arrow and written by delta-rs from the driver (a Spark job and a listing less);
* merges (upserts, a backfill's quarantine lines not yet present, deletions of absorbed late rows)
  find their rows on the executors and hand delta-rs only those rows (or keys).

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

import json
import uuid
from datetime import datetime, timezone
from typing import Mapping, Sequence
from urllib.parse import unquote

import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import types as T
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

from ...declaration import Table
from ...errors import SinkCommitError
from ...spark.jvm import collect_arrow
from .base import COMMIT_KEY, OP, WATERMARK_KEY, Commit, later_batch, with_retries


GENERATED = "delta.generationExpression"  # field metadata key of Delta's generated columns
DAY_MS = 86_400_000
# A write of at most this many rows, counted beforehand, is collected and written by delta-rs from the driver;
# more rows, or rows not counted, are written by the executors (see the module).
SMALL_WRITE_ROWS = 50_000
WRITES_FOLDER = "lakestream"  # (data files the executors write: <table>/lakestream-<uuid>/<_DAY>=<day>/...)
_DAY = "lakestream_day"


def _ts(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


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
        """``rows``: the frame's row count (or a bound on it), when known: a small frame is written from the
        driver, any other by the executors (see the module)."""
        from deltalake import write_deltalake

        if may_exist and self.is_committed(commit):
            return False
        if rows is None or rows > SMALL_WRITE_ROWS:
            self._commit_files(frame, "append", commit=commit)
            return True
        data = to_arrow(frame)
        with_retries(self.table, lambda: write_deltalake(self.uri, data, mode="append", storage_options=self.options,
                                                         commit_properties=self._properties(commit)),
                     already=lambda: self.is_committed(commit))
        return True

    # -- data files written by the executors ----------------------------------------------
    def _partitioning(self, table) -> tuple[list[str], dict[str, str]]:
        """The table's partition columns, and those of them generated from another column (name -> source)."""
        columns = list(table.metadata().partition_columns)
        generated = {}
        arrow = pa.schema(table.schema().to_arrow())
        for f in arrow:
            expression = (f.metadata or {}).get(GENERATED.encode())
            if f.name in columns and expression:
                text = expression.decode()
                if text.upper().startswith("CAST(") and text.upper().endswith(" AS DATE)"):
                    generated[f.name] = text[5:-9].strip().strip("`")
        return columns, generated

    def _write_files(self, frame: DataFrame, table) -> list:
        """Write ``frame``'s rows as Parquet data files into a new folder of the table, from the executors (Spark's
        writer, one folder per partition value), and return their add actions (path, size, partition values,
        row count), read from the files' footers. The files hold every column of the table but the generated
        ones (a partition column that is a column of the rows stays in them too)."""
        from pyspark.sql import functions as F

        columns, generated = self._partitioning(table)
        if len(columns) > 1:
            raise ValueError(f"{self.uri}: lakestream writes tables partitioned by one day column, not {columns}")
        if columns:
            source = generated.get(columns[0])
            day = F.to_date(F.col(source)) if source else F.col(columns[0])  # (the session's time zone is UTC, as Delta's)
            frame = frame.withColumn(_DAY, day)
        folder = f"{WRITES_FOLDER}-{uuid.uuid4().hex}"
        writer = frame.write.mode("errorifexists").option("mapreduce.fileoutputcommitter.marksuccessfuljobs", "false")
        if columns:
            writer = writer.partitionBy(_DAY)
        writer.parquet(f"{self.uri.rstrip('/')}/{folder}")
        return self._add_actions(folder, {_DAY: columns[0]} if columns else {})

    def _add_actions(self, folder: str, columns: dict[str, str]) -> list:
        import pyarrow.fs as pafs
        import pyarrow.parquet as pq
        from deltalake.fs import DeltaStorageHandler
        from deltalake.transaction import AddAction

        fs = pafs.PyFileSystem(DeltaStorageHandler(self.uri, self.options))
        actions = []
        for info in fs.get_file_info(pafs.FileSelector(folder, recursive=True, allow_not_found=True)):
            name = info.path.rsplit("/", 1)[-1]
            if info.type != pafs.FileType.File or name.startswith((".", "_")) or not name.endswith(".parquet"):
                continue  # (Hadoop's checksum files, Spark's markers)
            values = {}
            for part in info.path.split("/")[1:-1]:  # (folder names: <writer's column>=<value>)
                key, _, value = part.partition("=")
                if key in columns:
                    value = unquote(value)
                    values[columns[key]] = None if value == "__HIVE_DEFAULT_PARTITION__" else value
            with fs.open_input_file(info.path) as handle:
                rows = pq.ParquetFile(handle).metadata.num_rows
            modified = int(info.mtime.timestamp() * 1000) if info.mtime is not None else int(datetime.now().timestamp() * 1000)
            actions.append(AddAction(info.path, info.size, values, modified, True, json.dumps({"numRecords": rows})))
        return actions

    def _discard(self, folder_of: list) -> None:
        """Delete data files written for a commit that did not happen (best effort: unreferenced files are
        invisible to readers either way)."""
        import pyarrow.fs as pafs
        from deltalake.fs import DeltaStorageHandler

        fs = pafs.PyFileSystem(DeltaStorageHandler(self.uri, self.options))
        for folder in {a.path.split("/", 1)[0] for a in folder_of}:
            try:
                fs.delete_dir(folder)
            except Exception:  # noqa: BLE001 - best effort
                pass

    def _commit_files(self, frame: DataFrame, mode: str, *, commit: Commit | None = None,
                      properties: Mapping[str, str] | None = None, days: list[str] | None = None,
                      table=None, kept: list[str] | None = None) -> None:
        """Write ``frame`` from the executors and commit its files as one transaction: an append, or (``days``)
        an overwrite of those day partitions. ``table``: the table as read before (its version is what the
        transaction checks concurrent commits against). ``kept``: the data files whose rows ``frame`` carries
        over (a partly replaced day's other rows): a commit that conflicts is retried only while they are all
        still in the table, else those rows may be stale and the write fails (nothing is committed)."""
        table = table or self._dt()
        actions = self._write_files(frame, table)
        columns, _ = self._partitioning(table)
        filters = [(columns[0], "in", days)] if days else None

        def attempt() -> None:
            current = table if attempt.first else self._dt()
            if kept and not attempt.first and not set(kept) <= set(current.file_uris(partition_filters=filters)):
                raise SinkCommitError(
                    f"{self.table.name}: another writer replaced rows of the days {', '.join(days or [])} while this "
                    "write carried their rows outside its range over; nothing was committed (run the backfill again)")
            attempt.first = False
            current.create_write_transaction(actions, mode, current.schema(), partition_by=columns or None,
                                             partition_filters=filters,
                                             commit_properties=self._properties(commit, properties))

        attempt.first = True
        try:
            with_retries(self.table, attempt, already=(lambda: self.is_committed(commit)) if commit else None)
        except BaseException:
            self._discard(actions)
            raise

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
        """The rows of ``[lo, hi)`` become ``frame``'s, atomically. On a table partitioned by day the executors write
        the new files and one transaction replaces the days the range touches (a day only partly in the range
        keeps its other rows, read and written again with the new ones); an unpartitioned table is overwritten
        by delta-rs from the driver."""
        from deltalake import write_deltalake
        from pyspark.sql import functions as F

        table = self._dt()
        columns, generated = self._partitioning(table)
        if len(columns) == 1 and (generated.get(columns[0]) == column or columns[0] == column):
            first, last = lo_ms // DAY_MS, (hi_ms - 1) // DAY_MS
            days = [datetime.fromtimestamp(d * 86_400, tz=timezone.utc).strftime("%Y-%m-%d") for d in range(first, last + 1)]
            files = None
            if lo_ms % DAY_MS or hi_ms % DAY_MS:  # the touched days' rows outside the range stay
                files = table.file_uris(partition_filters=[(columns[0], "in", days)])
                if files:
                    t = F.col(column)
                    kept = self._read_files(table, files).where(
                        (t < F.lit(_ts(lo_ms))) | (t >= F.lit(_ts(hi_ms))))
                    frame = frame.unionByName(kept.select(*frame.columns))
            self._commit_files(frame, "overwrite", properties=properties, days=days, table=table, kept=files)
            return
        data = to_arrow(frame)
        predicate = f"{column} >= '{_iso(lo_ms)}' AND {column} < '{_iso(hi_ms)}'"
        with_retries(self.table, lambda: write_deltalake(
            self.uri, data, mode="overwrite", predicate=predicate, storage_options=self.options,
            commit_properties=self._properties(None, properties)))

    def insert_missing(self, frame: DataFrame, on: Sequence[str], properties: Mapping[str, str]) -> None:
        """Insert the rows of ``frame`` that the table does not hold (matched on ``on``): found on the executors,
        and only they reach delta-rs's merge (which checks again, against commits made meanwhile)."""
        existing = self.read().select(*on)
        condition = None
        for c in on:
            same = frame[c].eqNullSafe(existing[c])
            condition = same if condition is None else condition & same
        data = to_arrow(frame.join(existing, condition, "left_anti"))
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

    def version_before(self, app_id: str, batch_id: int, flush_kept: bool = False) -> int | None:
        """The version that holds this table as the stream ``app_id`` left it after batch ``batch_id``: the one
        before its first commit of a later batch, or the current version when it has none."""
        if not self.exists():
            return None
        later = [h["version"] for h in self._dt().history()
                 if later_batch(h.get(COMMIT_KEY), app_id, batch_id, flush_kept)]
        return min(later) - 1 if later else self.version()

    def expire(self, retention_ms: int) -> tuple[int, int]:
        """Nothing to do: delta-rs's post-commit hook writes a checkpoint every ``delta.checkpointInterval`` versions
        and removes log files older than ``delta.logRetentionDuration``, so the log a commit reads stays flat."""
        return 0, 0

    def tag(self, version: int, name: str) -> bool:
        """Delta has no tags: a version stays loadable while its log files do (``delta.logRetentionDuration``)."""
        return self.has_version(version)

    def untag(self, name: str) -> None:
        return None

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
        return self._read_files(table, table.file_uris())

    def _read_files(self, table, files: list[str]) -> DataFrame:
        """The rows of some of the table's files, without its generated columns (partition values are not in
        the files: read with the partition columns left out)."""
        arrow = pa.schema(table.schema().to_arrow())  # delta-rs hands out arro3 schemas
        schema = from_arrow_schema(pa.schema([f for f in arrow if GENERATED.encode() not in (f.metadata or {})]))
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
