"""The engine's own state, kept inside the Spark checkpoint folder (``<checkpoint>/lakestream``).

Layout, one set per micro-batch ``N`` (the two latest are kept)::

    lakestream/batches/N.json      batch record: watermark in/out, statistics, state schemas
    lakestream/windows/N/          open windows (partial aggregates) after batch N, Parquet
    lakestream/seen/N/             dedup keys still remembered after batch N, Parquet
    lakestream/intents/N           written before batch N's first table commit

Keyed jobs keep their state in Spark's state store and write only the batch records here.

The JSON record is written last: it marks batch N's state complete. The intent marker tells a
replay whether batch N may already have committed to some table (only then are the tables'
snapshot logs searched for the batch's commit id). Batch N always starts from
the newest record *below* N, so replaying a batch after a crash recomputes exactly the same
outputs (Spark replays the same input files), which is what makes the sinks exactly-once.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from pyspark.sql import DataFrame
from pyspark.sql import types as T

from .engine import BatchStats
from .errors import CheckpointCorruptError, IncompatibleStateError
from .hadoopfs import HadoopFS

KEEP_BATCHES = 2
FORMAT = 2  # 2: windows carry _fired/_in_sink, remembered keys a string `key`, several sources


@dataclass(frozen=True)
class BatchRecord:
    batch_id: int
    stats: BatchStats
    totals: BatchStats  # cumulative over the stream's life, this batch included
    windows_schema: str | None
    seen_schema: str | None
    job_fingerprint: str
    job_shape: dict | None = None  # keys, window, aggregates (absent in records of older versions)
    format: int = FORMAT

    @property
    def watermark_ms(self) -> int:
        return self.stats.watermark_out_ms


@dataclass(frozen=True)
class LoadedState:
    record: BatchRecord | None
    open_windows: DataFrame | None
    seen_keys: DataFrame | None


class EngineState:
    def __init__(self, spark, checkpoint_dir: str):
        self._spark = spark
        self._fs = HadoopFS(spark)
        self.root = f"{checkpoint_dir.rstrip('/')}/lakestream"

    def batch_ids(self) -> list[int]:
        ids = []
        for name in self._fs.list_names(f"{self.root}/batches"):
            if name.endswith(".json") and name[:-5].isdigit():
                ids.append(int(name[:-5]))
        return sorted(ids)

    def read_record(self, batch_id: int) -> BatchRecord:
        path = f"{self.root}/batches/{batch_id}.json"
        try:
            data = json.loads(self._fs.read_text(path))
            if data.get("format", 1) != FORMAT:
                raise IncompatibleStateError(
                    f"{path} was written by an older lakestream (engine state format {data.get('format', 1)}, this "
                    f"version uses {FORMAT}); move {self.root.rsplit('/', 1)[0]} away to start over and backfill the tables"
                )
            return BatchRecord(
                batch_id=data["batch_id"],
                stats=BatchStats(**data["stats"]),
                totals=BatchStats(**data["totals"]),
                windows_schema=data["windows_schema"],
                seen_schema=data["seen_schema"],
                job_fingerprint=data["job_fingerprint"],
                job_shape=data.get("job_shape"),
                format=data.get("format", 1),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointCorruptError(
                f"batch record {path} is unreadable ({exc}); restore a savepoint or delete the checkpoint to start over"
            ) from None

    def latest_record(self) -> BatchRecord | None:
        ids = self.batch_ids()
        return self.read_record(ids[-1]) if ids else None

    def latest_record_before(self, batch_id: int) -> BatchRecord | None:
        earlier = [i for i in self.batch_ids() if i < batch_id]
        return self.read_record(earlier[-1]) if earlier else None

    def load_before(self, batch_id: int) -> LoadedState:
        earlier = [i for i in self.batch_ids() if i < batch_id]
        if not earlier:
            return LoadedState(None, None, None)
        record = self.read_record(earlier[-1])
        if record.windows_schema is None:
            return LoadedState(record, None, None)
        read = self._spark.read
        windows = read.schema(T.StructType.fromJson(json.loads(record.windows_schema))).parquet(
            f"{self.root}/windows/{record.batch_id}"
        )
        seen = read.schema(T.StructType.fromJson(json.loads(record.seen_schema))).parquet(
            f"{self.root}/seen/{record.batch_id}"
        )
        return LoadedState(record, windows, seen)

    def has_intent(self, batch_id: int) -> bool:
        return self._fs.exists(f"{self.root}/intents/{batch_id}")

    def mark_intent(self, batch_id: int) -> None:
        self._fs.write_text(f"{self.root}/intents/{batch_id}", "")

    def save(
        self,
        batch_id: int,
        stats: BatchStats,
        totals: BatchStats,
        open_windows: DataFrame | None,
        seen_keys: DataFrame | None,
        fingerprint: str,
        shape: dict | None = None,
        state_bytes: int | None = None,
    ) -> None:
        """Record batch ``batch_id`` (and, for windowed jobs, its open windows and remembered keys)."""
        if open_windows is not None:
            open_windows.write.mode("overwrite").parquet(f"{self.root}/windows/{batch_id}")
        if seen_keys is not None:
            seen_keys.write.mode("overwrite").parquet(f"{self.root}/seen/{batch_id}")
        record = {
            "format": FORMAT,
            "batch_id": batch_id,
            "stats": asdict(stats),
            "totals": asdict(totals),
            "windows_schema": open_windows.schema.json() if open_windows is not None else None,
            "seen_schema": seen_keys.schema.json() if seen_keys is not None else None,
            "job_fingerprint": fingerprint,
            "job_shape": shape,
            "state_bytes": state_bytes,  # keyed jobs: Spark's state store on disk after the batch
        }
        self._fs.write_text(f"{self.root}/batches/{batch_id}.json", json.dumps(record, indent=1))
        for old in self.batch_ids()[:-KEEP_BATCHES]:
            for part in ("windows", "seen"):
                self._fs.delete(f"{self.root}/{part}/{old}")
            self._fs.delete(f"{self.root}/batches/{old}.json")
            self._fs.delete(f"{self.root}/intents/{old}")
