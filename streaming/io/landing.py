"""Reading a source's landing folder, as a stream or as a batch, in its declared format.

Every format arrives at the parser as the same frame: ``value`` (one record's text), ``source_file``,
``_source`` (the source's name) and ``_problem`` (a reason found before parsing, else NULL):

* ``json`` and ``csv``: Spark's text source, one line per record (the parser knows the format);
* ``parquet``: Spark's binary-file source (so the stream's file log and exactly-once rules are the
  same as for text), each file's rows turned into JSON objects on the executors, with the file's own
  types written as text, so the declared types are checked exactly as for JSON. A file that is not
  Parquet becomes one quarantine record naming the file and the error, never a crashed stream.
* ``table``: an append-only Iceberg table (another job's output): Spark's Iceberg streaming read
  follows its appended snapshots (replacements and deletes, e.g. an upstream backfill, are not
  re-read: the downstream's bounded twin picks them up); a batch read takes the table as of a
  snapshot. Each row becomes a JSON object of the declared fields (``source_file``: its data file).
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import io
import json
import math

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ..declaration import Source
from .parse import PROBLEM

SOURCE = "_source"  # raw frames of multi-source jobs say which source a line came from
_BINARY_FILE = "path string, modificationTime timestamp, length long, content binary"
_PARQUET_ROWS = "value string, source_file string, _problem string"


def read_source(spark, folder_or_files: str | list[str] | None, source: Source, *, stream: bool,
                max_files_per_trigger: int | None = None, snapshot: int | None = None) -> DataFrame:
    """The records of ``source`` under ``folder_or_files`` (a folder; batch reads may list files);
    a table source reads its table (``snapshot``: as of that snapshot, batch reads only)."""
    if source.is_table:
        return _read_table(spark, source, stream=stream, max_files_per_trigger=max_files_per_trigger,
                           snapshot=snapshot)
    binary = source.format == "parquet"
    if stream:
        # A landing file deleted between the listing that planned a batch and its reading: the batch goes on
        # with the files that are there (Spark's default fails it, and every replay of it, for ever). Only the
        # landing read: the store's own files must never go missing unnoticed.
        reader = spark.readStream.format("binaryFile" if binary else "text").option("ignoreMissingFiles", "true")
        if max_files_per_trigger is not None:
            reader = reader.option("maxFilesPerTrigger", max_files_per_trigger)
    else:
        reader = spark.read.format("binaryFile" if binary else "text")
    if binary:
        reader = reader.schema(_BINARY_FILE)  # a stream must be told (Spark's binary-file schema)
    frame = reader.load(folder_or_files)
    if binary:
        frame = frame.select(F.col("_metadata.file_path").alias("path"), "content").mapInPandas(
            _parquet_records, _PARQUET_ROWS)
        return frame.select("value", "source_file", F.lit(source.name).alias(SOURCE), PROBLEM)
    return frame.select("value", F.col("_metadata.file_path").alias("source_file"), F.lit(source.name).alias(SOURCE),
                        F.lit(None).cast("string").alias(PROBLEM))


def check_table_source(spark, source: Source) -> None:
    """Refuse, in one line, a table source whose table is missing or is not append-only."""
    from ..errors import ConfigError

    table = source.location
    if not spark.catalog.tableExists(table):
        raise ConfigError(f"source {source.name} reads table {table}, which does not exist yet: run the job that "
                          f"writes it first (table sources read Iceberg tables of the 'lake' catalog)")
    props = {r.key: r.value for r in spark.sql(f"SHOW TBLPROPERTIES {table}").collect()}
    if props.get("write.merge.mode") == "merge-on-read":  # lakestream's upserted tables (see IcebergSink.ensure)
        raise ConfigError(f"source {source.name} reads {table}, which its job upserts (allowed lateness or sessions): "
                          f"a table source must be append-only; read that job's late table or set its lateness to 0")


def _read_table(spark, source: Source, *, stream: bool, max_files_per_trigger: int | None,
                snapshot: int | None) -> DataFrame:
    check_table_source(spark, source)
    if stream:
        reader = (spark.readStream.format("iceberg")
                  .option("streaming-skip-delete-snapshots", "true")
                  .option("streaming-skip-overwrite-snapshots", "true"))
        if max_files_per_trigger is not None:
            reader = reader.option("streaming-max-files-per-micro-batch", max_files_per_trigger)
    else:
        reader = spark.read.format("iceberg")
        if snapshot is not None:
            reader = reader.option("snapshot-id", int(snapshot))
    frame = reader.load(source.location)
    present = set(frame.columns)
    built = source.dedup_key if source.dedup_from else None
    members = [F.col(f.name) for f in source.fields if f.name in present and f.name != built]
    if source.dedup_from:
        members.append(F.concat_ws("|", *[F.col(c).cast("string") for c in source.dedup_from if c in present])
                       .alias(source.dedup_key))
    return frame.select(F.to_json(F.struct(*members)).alias("value"), F.input_file_name().alias("source_file"),
                        F.lit(source.name).alias(SOURCE), F.lit(None).cast("string").alias(PROBLEM))


def union(frames: list[DataFrame]) -> DataFrame:
    raw = frames[0]
    for frame in frames[1:]:
        raw = raw.unionByName(frame)
    return raw


def _text(value):
    """A Parquet value as the JSON the parser checks: numbers and booleans as such, the rest as text."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)  # NaN/inf: text, which no number rule accepts
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:  # Parquet's timestamps without a zone are taken as UTC (Spark writes them so)
            return value.isoformat(timespec="microseconds") + "Z"
        return value.astimezone(dt.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return "base64:" + base64.b64encode(value).decode("ascii")
    return json.dumps(value, default=str)


def _parquet_records(batches):
    import pandas as pd
    import pyarrow.parquet as pq

    for batch in batches:
        out = {"value": [], "source_file": [], PROBLEM: []}
        for path, content in zip(batch["path"], batch["content"]):
            try:
                rows = pq.read_table(io.BytesIO(content)).to_pylist()
            except Exception as exc:  # noqa: BLE001 - any unreadable file is a quarantine record, not a crash
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                out["value"].append(f"(unreadable file of {len(content)} bytes)")
                out["source_file"].append(path)
                out[PROBLEM].append(f"unreadable Parquet file: {reason[:200]}")
                continue
            for row in rows:
                out["value"].append(json.dumps({k: _text(v) for k, v in row.items()}, allow_nan=False))
                out["source_file"].append(path)
                out[PROBLEM].append(None)
        yield pd.DataFrame(out, columns=["value", "source_file", PROBLEM])
