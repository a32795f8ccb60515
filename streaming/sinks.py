"""Exactly-once writes to Iceberg tables.

* **Stream appends** carry a commit id (``<query id>:<batch id>``) in the snapshot summary
  (``lakestream.commit``). Before appending, the table's snapshot log is searched for that id: a
  batch replayed after a crash finds its earlier commit and skips it. One Iceberg commit per table
  per batch is atomic, so a table holds a batch entirely or not at all.
* **Quarantine** rows are merged insert-if-absent on ``(source_file, raw_line)``: a line is
  quarantined once, whether by the stream, a replay or a backfill.
* **Range replacement** (bounded twins) replaces exactly the rows whose ``window_start`` lies in
  ``[start, end)`` in one atomic commit: a metadata-only overwrite when the range is whole days
  (the tables are partitioned by day), else a MERGE that also deletes the stale rows of the range.
"""

from __future__ import annotations

import itertools
from datetime import datetime, timezone
from typing import Mapping, Sequence

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from .declaration import IcebergTable

COMMIT_KEY = "lakestream.commit"
DAY_MS = 86_400_000
_views = itertools.count()


def ensure_table(spark, table: IcebergTable, schema: T.StructType, partition_by: str | None, comment: str = "") -> None:
    spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {table.namespace}")
    columns = ", ".join(f"`{f.name}` {f.dataType.simpleString()}" for f in schema.fields)
    partition = f"PARTITIONED BY ({partition_by})" if partition_by else ""
    text = comment.replace("'", "''")
    spark.sql(
        f"CREATE TABLE IF NOT EXISTS {table.name} ({columns}) USING iceberg {partition} "
        f"COMMENT '{text}' TBLPROPERTIES ('format-version'='2', 'write.distribution-mode'='hash')"
    )


def is_committed(spark, table: IcebergTable, commit_id: str) -> bool:
    """True if a snapshot in the table's *current* lineage carries ``commit_id``.

    Snapshots that a rollback (savepoint restore) cut off do not count: their batches must be written again.
    """
    found = spark.sql(
        f"SELECT 1 FROM {table.name}.snapshots s JOIN {table.name}.history h ON s.snapshot_id = h.snapshot_id "
        f"WHERE h.is_current_ancestor AND s.summary['{COMMIT_KEY}'] = '{commit_id}' LIMIT 1"
    ).collect()
    return bool(found)


def append_once(
    frame: DataFrame, table: IcebergTable, commit_id: str, properties: Mapping[str, str] = {}, *, may_exist: bool = True
) -> bool:
    """Append ``frame`` unless a snapshot with ``commit_id`` exists. True when it wrote.

    ``may_exist=False`` skips the search when the caller knows the commit cannot exist yet.
    """
    if may_exist and is_committed(frame.sparkSession, table, commit_id):
        return False
    writer = frame.writeTo(table.name).option(f"snapshot-property.{COMMIT_KEY}", commit_id)
    for key, value in properties.items():
        writer = writer.option(f"snapshot-property.{key}", str(value))
    writer.append()
    return True


def merge_quarantine(frame: DataFrame, table: IcebergTable) -> None:
    view = f"lakestream_quarantine_{next(_views)}"
    frame.createOrReplaceTempView(view)
    try:
        frame.sparkSession.sql(
            f"MERGE INTO {table.name} t USING {view} s "
            "ON t.source_file = s.source_file AND t.raw_line = s.raw_line "
            "WHEN NOT MATCHED THEN INSERT *"
        )
    finally:
        frame.sparkSession.catalog.dropTempView(view)


def _ts(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


def replace_range(
    frame: DataFrame,
    table: IcebergTable,
    start_ms: int,
    end_ms: int,
    keys: Sequence[str],
    properties: Mapping[str, str] = {},
    column: str = "window_start",
) -> None:
    """Make the rows of ``table`` with ``column`` in ``[start, end)`` exactly ``frame``, atomically."""
    start, end = _ts(start_ms), _ts(end_ms)
    if start_ms % DAY_MS == 0 and end_ms % DAY_MS == 0:
        writer = frame.writeTo(table.name)
        for key, value in properties.items():
            writer = writer.option(f"snapshot-property.{key}", str(value))
        writer.overwrite((F.col(column) >= F.lit(start)) & (F.col(column) < F.lit(end)))
        return
    view = f"lakestream_replace_{next(_views)}"
    frame.createOrReplaceTempView(view)
    on = " AND ".join(f"t.`{k}` <=> s.`{k}`" for k in (*keys, column))
    lo, hi = start.strftime("%Y-%m-%d %H:%M:%S.%f"), end.strftime("%Y-%m-%d %H:%M:%S.%f")
    try:
        frame.sparkSession.sql(
            f"MERGE INTO {table.name} t USING {view} s ON {on} "
            "WHEN MATCHED THEN UPDATE SET * WHEN NOT MATCHED THEN INSERT * "
            f"WHEN NOT MATCHED BY SOURCE AND t.`{column}` >= TIMESTAMP '{lo}' AND t.`{column}` < TIMESTAMP '{hi}' "
            "THEN DELETE"
        )
    finally:
        frame.sparkSession.catalog.dropTempView(view)
