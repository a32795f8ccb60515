"""Files in a landing folder (``json``, ``csv``, ``parquet``), filled in arrival order (a file, once there, is
not changed), read in arrival order (Spark's file source orders by modification time).

* ``json`` and ``csv``: Spark's text source, one line per record (the parser knows the format);
* ``parquet``: Spark's binary-file source (so the stream's file log and exactly-once rules are the
  same as for text), each file's rows turned into JSON objects on the executors, with the file's own
  types written as text, so the declared types are checked exactly as for JSON. A file that is not
  Parquet becomes one quarantine record naming the file and the error, never a crashed stream.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import io
import json
import math
import os
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ...errors import ConfigError, DateRangeError, DeclarationError
from ..parse import PROBLEM
from .base import SOURCE, SourceKind

_BINARY_FILE = "path string, modificationTime timestamp, length long, content binary"
_PARQUET_ROWS = "value string, source_file string, _problem string"
_EXTENSIONS = {"json": "jsonl", "csv": "csv", "parquet": "parquet"}


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
        reader = spark.readStream.format("binaryFile" if source.format == "parquet" else "text") \
            .option("ignoreMissingFiles", "true")
        if max_files_per_trigger is not None:
            reader = reader.option("maxFilesPerTrigger", max_files_per_trigger)
        return self._records(reader, landing, source)

    def read(self, spark, settings, source, *, position: int | None = None,
             files: list[str] | None = None) -> DataFrame:
        from ...spark.hadoopfs import HadoopFS

        if files is None:
            landing = settings.landing_dir(source)
            if not HadoopFS(spark).exists(landing):
                raise DateRangeError(f"no landing data at {landing}; run `lakestream generate` first or fix 'landing'")
        reader = spark.read.format("binaryFile" if source.format == "parquet" else "text")
        return self._records(reader, files if files is not None else settings.landing_dir(source), source)

    @staticmethod
    def _records(reader, folder_or_files, source) -> DataFrame:
        if source.format == "parquet":
            frame = reader.schema(_BINARY_FILE).load(folder_or_files)  # (a stream must be told the schema)
            frame = frame.select(F.col("_metadata.file_path").alias("path"), "content").mapInPandas(
                _parquet_records, _PARQUET_ROWS)
            return frame.select("value", "source_file", F.lit(source.name).alias(SOURCE), PROBLEM)
        frame = reader.load(folder_or_files)
        return frame.select("value", F.col("_metadata.file_path").alias("source_file"), F.lit(source.name).alias(SOURCE),
                            F.lit(None).cast("string").alias(PROBLEM))

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
