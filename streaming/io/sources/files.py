"""Files in a landing folder (``json``, ``csv``, ``parquet``), filled in arrival order (a file, once there, is
not changed), read in arrival order (Spark's file source orders by modification time).

* ``json`` and ``csv``: Spark's text source, one line per record (the parser knows the format);
* ``parquet``: Spark's binary-file source lists the files (so the stream's file log and exactly-once rules
  are the same as for text) without reading their bytes; each executor task opens its file and turns
  its rows into JSON objects a row group at a time (``PARQUET_CHUNK_ROWS`` rows at most in memory), with
  the file's own types written as text, so the declared types are checked exactly as for JSON. A file
  of any size streams; one that is not Parquet, or that breaks off, becomes one quarantine record naming
  the file, how many rows it gave, and the error, never a crashed stream.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import math
import os
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ...errors import ConfigError, DateRangeError, DeclarationError
from ...spark import pyworkers
from ..parse import ARRIVAL, PROBLEM
from .base import SOURCE, SourceKind, arrival

_BINARY_FILE = "path string, modificationTime timestamp, length long, content binary"
_PARQUET_ROWS = "value string, source_file string, _arrival long, _problem string"
_EXTENSIONS = {"json": "jsonl", "csv": "csv", "parquet": "parquet"}
MAX_FILE_AGE = "36500d"  # (Spark's stream remembers every file it has read in its source log, whatever this is)


class Files(SourceKind):
    name = "files"
    one_delivery_per_trigger = True
    lands_in_folder = True

    def check(self, source) -> None:
        if source.dedup_from:
            raise DeclarationError(f"Source {source.name}: dedup_from is for table sources; files carry their own "
                                   f"dedup key field")

    def location(self, settings, source) -> str:
        return settings.landing_dir(source)

    def landing_folder(self, settings, source) -> str | None:
        return settings.landing_dir(source)

    # -- reading --------------------------------------------------------------------------------
    def stream(self, spark, settings, source, *, max_files_per_trigger: int | None) -> DataFrame:
        from ...spark.hadoopfs import HadoopFS

        landing = settings.landing_dir(source)
        fs = HadoopFS(spark)
        if not fs.exists(landing):
            if not settings.is_local:
                raise ConfigError(f"landing folder {landing} does not exist; create it or fix 'landing' in the settings")
            fs.mkdirs(landing)
        # A landing file deleted between the listing that planned a batch and its reading: the batch goes on
        # with the files that are there (Spark's default fails it, and every replay of it, for ever). Only the
        # landing read: the store's own files must never go missing unnoticed.
        # A file is read whatever its modification time: Spark's file source ignores files more than
        # ``maxFileAge`` (7 days by default) older than the newest file it has seen, and a file copied in with
        # its times kept (cp -p, rsync -a, tar x, a mv from a staging folder) would never be read.
        reader = spark.readStream.format("binaryFile" if source.format == "parquet" else "text") \
            .option("ignoreMissingFiles", "true").option("maxFileAge", MAX_FILE_AGE)
        if max_files_per_trigger is not None:
            reader = reader.option("maxFilesPerTrigger", max_files_per_trigger)
        return self._records(reader, landing, source, settings)

    def read(self, spark, settings, source, *, position: int | None = None,
             files: list[str] | None = None) -> DataFrame:
        from ...spark.hadoopfs import HadoopFS

        if files is None:
            landing = settings.landing_dir(source)
            if not HadoopFS(spark).exists(landing):
                raise DateRangeError(f"no landing data at {landing}; run `lakestream generate` first or fix 'landing'")
        reader = spark.read.format("binaryFile" if source.format == "parquet" else "text")
        return self._records(reader, files if files is not None else settings.landing_dir(source), source, settings)

    @staticmethod
    def _records(reader, folder_or_files, source, settings) -> DataFrame:
        if source.format == "parquet":
            frame = reader.schema(_BINARY_FILE).load(folder_or_files)  # (a stream must be told the schema)
            # Only the path: the binary-file source then lists files without reading them (their bytes would
            # be one value of at most 2 GiB, read whole into one task's memory).
            frame = frame.select(F.col("_metadata.file_path").alias("path"), _arrival().alias(ARRIVAL)).mapInPandas(
                _parquet_reader(dict(settings.storage_options)), _PARQUET_ROWS)
            return frame.select("value", "source_file", F.lit(source.name).alias(SOURCE), ARRIVAL, PROBLEM)
        frame = reader.load(folder_or_files)
        return frame.select("value", F.col("_metadata.file_path").alias("source_file"), F.lit(source.name).alias(SOURCE),
                            _arrival().alias(ARRIVAL), F.lit(None).cast("string").alias(PROBLEM))

    # -- tests ----------------------------------------------------------------------------------
    def land(self, spark, settings, source, records: Any, name: str, *, empty: bool = False,
             mtime: float | None = None) -> list[Path]:
        if records is None or len(records) == 0:
            if not empty:
                return []
            records = []
        folder = Path(settings.landing_dir(source))
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}.{_EXTENSIONS[source.format]}"
        tmp = path.with_name("." + path.name)  # appear whole: Spark must never list a half-written file
        if source.format == "parquet":
            import pandas as pd

            frame = records if isinstance(records, pd.DataFrame) else pd.DataFrame(list(records))
            frame.to_parquet(tmp, index=False)
        else:
            lines = [r if isinstance(r, str) else json.dumps(r, default=str) for r in records]
            if source.format == "csv" and source.header:
                lines = [source.delimiter.join(source.field_names), *lines]
            tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        tmp.rename(path)
        if mtime is not None:
            os.utime(path, (mtime, mtime))
        return [path]


def _arrival():
    meta = F.col("_metadata")
    return arrival(meta["file_modification_time"], meta["file_path"], meta["file_block_start"])


KIND = Files()


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


PARQUET_CHUNK_ROWS = 10_000  # rows of a Parquet file in a task's memory at once


def _parquet_reader(storage_options: dict):
    """The ``mapInPandas`` function that turns the listed Parquet files into records, on the executors (it
    reads each file through fsspec: local disks, and object stores with the settings' storage options)."""

    def records(batches):
        pyworkers.prepare()
        for batch in batches:
            for path, arrived in zip(batch["path"], batch[ARRIVAL]):
                for frame in _file_records(path, storage_options):
                    frame.insert(2, ARRIVAL, int(arrived))
                    yield frame

    return records


def _file_records(path: str, storage_options: dict, chunk_rows: int = PARQUET_CHUNK_ROWS):
    import fsspec
    import pandas as pd
    import pyarrow.parquet as pq

    def frame(values: list, problems: list) -> pd.DataFrame:
        return pd.DataFrame({"value": values, "source_file": [path] * len(values), PROBLEM: problems},
                            columns=["value", "source_file", PROBLEM])

    rows = 0
    try:
        fs, local = fsspec.core.url_to_fs(path, **storage_options)
        with fs.open(local, "rb") as handle:
            for batch in pq.ParquetFile(handle).iter_batches(batch_size=chunk_rows):
                values = [json.dumps({k: _text(v) for k, v in row.items()}, allow_nan=False) for row in batch.to_pylist()]
                rows += len(values)
                yield frame(values, [None] * len(values))
    except Exception as exc:  # noqa: BLE001 - an unreadable file (or its rest) is a quarantine record, not a crash
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = f"after row {rows}: " if rows else ""
        yield frame([f"(unreadable Parquet file; {rows} row(s) read before the error)"],
                    [f"unreadable Parquet file: {where}{reason[:200]}"])
