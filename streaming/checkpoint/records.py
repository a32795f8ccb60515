"""The engine's batch records, kept inside the Spark checkpoint (see ``layout``).

One JSON record per micro-batch ``N`` (the two newest are kept): its statistics, the stream's
totals, the watermark before and after it, the job's shape, and — for windowed jobs — the manifest
of the incremental store after it. The record is written last, after every table commit and the
store's files: it marks batch N complete on lakestream's side. Batch N always starts from the
newest record *below* N, so a batch Spark replays after a crash recomputes exactly the same outputs
(it reads the same input files), which is what makes the sinks exactly-once.

Records are read when a stream starts (one listing), then kept in memory: a running stream reads
nothing back between batches. Whether a batch may be a replay is known at start too: Spark replays
only the batch it had planned but not committed when it stopped.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..time import NEG_INF_MS
from ..errors import CheckpointCorruptError, IncompatibleStateError
from ..spark.hadoopfs import HadoopFS
from .layout import Layout, last_planned_and_committed
from .store import Manifest

@dataclass(frozen=True)
class BatchStats:
    """What one micro-batch (or bounded run) did; all counts are exact."""

    lines: int = 0
    quarantined: int = 0
    events: int = 0  # valid, deduplicated events (on time + late)
    duplicates: int = 0
    late: int = 0  # rows of the late side output (windowed: one per event and missed window)
    rows_written: int = 0  # main-table rows written (windows, keyed outputs)
    rows_deleted: int = 0  # main-table rows deleted (retracted sessions, windows that left ``having``)
    max_event_time_ms: int | None = None
    watermark_in_ms: int = NEG_INF_MS
    watermark_out_ms: int = NEG_INF_MS

    def plus(self, other: "BatchStats") -> "BatchStats":
        def mx(a, b):
            return b if a is None else a if b is None else max(a, b)

        return BatchStats(
            lines=self.lines + other.lines,
            quarantined=self.quarantined + other.quarantined,
            events=self.events + other.events,
            duplicates=self.duplicates + other.duplicates,
            late=self.late + other.late,
            rows_written=self.rows_written + other.rows_written,
            rows_deleted=self.rows_deleted + other.rows_deleted,
            max_event_time_ms=mx(self.max_event_time_ms, other.max_event_time_ms),
            watermark_in_ms=min(self.watermark_in_ms, other.watermark_in_ms),
            watermark_out_ms=max(self.watermark_out_ms, other.watermark_out_ms),
        )


KEEP_BATCHES = 2
FORMAT = 3  # 3: incremental store (ids, pieces, evals); keyed state in buckets of keys
# A keyed stream's records from the version that keeps each key's state in files (``keyed.files``): an older
# lakestream would read the buckets' group state as empty, so it must refuse the checkpoint, and it refuses
# any format but its own. This version reads both.
KEY_FILES_FORMAT = 4
# A windowed stream's record that holds side rows not committed yet (``pending``): an older lakestream would
# not commit them, so it must refuse the record; a record without any is written in ``FORMAT``.
PENDING_FORMAT = 5
# A keyed stream's records from the version whose key files may hold a key's state in part (the ids a batch added to
# what the key remembered, ``keyed.files``): an older lakestream would take the part for the whole and forget ids.
# 7: the part leaves out the key's buffered elements too (the ones a batch added, and the watermark it delivered up
# to); a reader of 6 would take a part without elements for the whole.
KEY_IDS_DELTAS_FORMAT = 6
KEY_DELTAS_FORMAT = 7
READABLE = (FORMAT, KEY_FILES_FORMAT, PENDING_FORMAT, KEY_IDS_DELTAS_FORMAT, KEY_DELTAS_FORMAT)


@dataclass(frozen=True)
class Pending:
    """Side rows a batch wrote into the checkpoint instead of their table (see ``run.side``): one Parquet folder."""

    table: str  # the side table they belong to
    path: str
    rows: int
    batch: int  # the batch that made them
    written_ms: int  # when (wall clock): a stream commits them once the oldest is ``side_outputs_every`` old

    @staticmethod
    def of(data: dict) -> "Pending":
        return Pending(**data)


@dataclass(frozen=True)
class BatchRecord:
    batch_id: int
    stats: BatchStats
    totals: BatchStats  # cumulative over the stream's life, this batch included
    job_fingerprint: str
    job_shape: dict | None = None
    store: Manifest = field(default_factory=Manifest)
    removed: tuple[str, ...] = ()  # store files this batch dropped (deleted once the next batch is recorded)
    state_rows: dict | None = None  # what the stream remembers after the batch (ids, open window pieces, keys)
    key_buckets: int | None = None  # keyed streams: how many groups the keys are bucketed in (fixed per checkpoint)
    bucket_labels: tuple[int, ...] | None = None  # keyed streams: each bucket's grouping value (None: the bucket number)
    format: int = FORMAT
    pending: tuple[Pending, ...] = ()  # windowed streams: side rows not committed to their tables yet

    @property
    def watermark_ms(self) -> int:
        return self.stats.watermark_out_ms

    def to_json(self) -> str:
        data = {
            "format": self.format, "batch_id": self.batch_id, "stats": asdict(self.stats), "totals": asdict(self.totals),
            "job_fingerprint": self.job_fingerprint, "job_shape": self.job_shape, "store": self.store.to_json(),
            "removed": list(self.removed), "state_rows": self.state_rows,
        }
        if self.key_buckets is not None:
            data["key_buckets"] = self.key_buckets
        if self.bucket_labels is not None:
            data["bucket_labels"] = list(self.bucket_labels)
        if self.pending:
            data["pending"] = [asdict(p) for p in self.pending]
            data["format"] = PENDING_FORMAT
        elif self.format == PENDING_FORMAT:
            data["format"] = FORMAT
        return json.dumps(data, indent=1)


def parse_record(text: str, path: str) -> BatchRecord:
    try:
        data = json.loads(text)
        found = data.get("format", 1)
        if found not in READABLE:
            if isinstance(found, int) and found > max(READABLE):
                raise IncompatibleStateError(
                    f"{path} was written by a newer lakestream (engine state format {found}, this version reads "
                    f"{' and '.join(map(str, READABLE))}): run the job with that version, or restore a savepoint "
                    "taken before it"
                )
            raise IncompatibleStateError(
                f"{path} was written by an older lakestream (engine state format {found}, this version "
                f"uses {FORMAT}) whose state it cannot read: move the checkpoint folder away to start over, then "
                "backfill the tables (lakestream backfill JOB --start ... --end ...)"
            )
        return BatchRecord(
            batch_id=data["batch_id"], stats=BatchStats(**data["stats"]), totals=BatchStats(**data["totals"]),
            job_fingerprint=data["job_fingerprint"], job_shape=data.get("job_shape"),
            store=Manifest.from_json(data.get("store")), removed=tuple(data.get("removed") or ()),
            state_rows=data.get("state_rows"), key_buckets=data.get("key_buckets"),
            bucket_labels=tuple(data["bucket_labels"]) if data.get("bucket_labels") is not None else None,
            format=data["format"], pending=tuple(Pending.of(p) for p in data.get("pending") or ()),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorruptError(
            f"batch record {path} is unreadable ({exc}); restore a savepoint or delete the checkpoint to start over"
        ) from None


class EngineState:
    """The records of one job's checkpoint, read through Spark's file system (any URI Spark reads)."""

    def __init__(self, spark, checkpoint_dir: str):
        self._fs = HadoopFS(spark)
        self.layout = Layout(checkpoint_dir)

    def batch_ids(self) -> list[int]:
        return sorted(int(n[:-5]) for n in self._fs.list_names(self.layout.batches) if n.endswith(".json")
                      and n[:-5].isdigit())

    def read_record(self, batch_id: int) -> BatchRecord:
        path = self.layout.record(batch_id)
        return parse_record(self._fs.read_text(path), path)

    def latest_record(self) -> BatchRecord | None:
        ids = self.batch_ids()
        return self.read_record(ids[-1]) if ids else None

    def latest_record_before(self, batch_id: int) -> BatchRecord | None:
        earlier = [i for i in self.batch_ids() if i < batch_id]
        return self.read_record(earlier[-1]) if earlier else None

    def refuse_legacy(self) -> None:
        """A checkpoint of a version before the incremental store cannot be resumed: say so once, clearly."""
        if any(self._fs.exists(p) for p in self.layout.legacy()):
            raise IncompatibleStateError(
                f"{self.layout.root} holds engine state of an older lakestream (open windows and remembered ids as "
                "whole Parquet copies) that this version does not read: move the checkpoint folder away to start "
                "over, then backfill the tables (lakestream backfill JOB --start ... --end ...)"
            )

    def replay_candidate(self) -> int | None:
        """The batch Spark will replay when the stream starts (planned but not committed), if any."""
        planned, committed = last_planned_and_committed(self._fs, self.layout)
        if planned is not None and (committed is None or planned > committed):
            return planned
        return None

    def save(self, record: BatchRecord) -> None:
        """Write the record of a batch, then forget what is no longer needed: the record two batches
        back and the store files the previous batch dropped (a replay can no longer need them)."""
        self._fs.write_text(self.layout.record(record.batch_id), record.to_json())
        self._fs.delete(self.layout.record(record.batch_id - KEEP_BATCHES))

    def forced_ranges(self) -> list[tuple[int, int]]:
        """Ranges ``[lo, hi)`` of window starts that a forced backfill wrote while the stream was stopped: the
        stream writes the windows there as upserts (they may be in the table already), not appends."""
        if not self._fs.exists(self.layout.forced):
            return []
        try:
            return [(int(lo), int(hi)) for lo, hi in json.loads(self._fs.read_text(self.layout.forced))]
        except (ValueError, TypeError):
            raise CheckpointCorruptError(f"{self.layout.forced} is unreadable; delete it only if no backfill was "
                                         "forced over this stream's open windows") from None

    def save_forced_ranges(self, ranges: list[tuple[int, int]]) -> None:
        if ranges:
            self._fs.write_text(self.layout.forced, json.dumps(sorted(ranges)))
        else:
            self._fs.delete(self.layout.forced)

    def delete_files(self, paths) -> None:
        for path in paths:
            self._fs.delete(path)


class Records:
    """The newest record before the running batch, held in memory while a stream runs."""

    def __init__(self, state: EngineState):
        self.state = state
        self._last: BatchRecord | None = None
        self._loaded_for: int | None = None

    def before(self, batch_id: int) -> BatchRecord | None:
        if self._last is not None and self._last.batch_id == batch_id - 1:
            return self._last
        if self._loaded_for != batch_id:  # the first batch of this run (or a replay): read once
            self.state.refuse_legacy()
            self._last = self.state.latest_record_before(batch_id)
            self._loaded_for = batch_id
        return self._last

    def latest(self) -> BatchRecord | None:
        """The newest record this run has read or written (None before its first batch)."""
        return self._last

    def committed(self, record: BatchRecord) -> None:
        self._last = record
        self._loaded_for = record.batch_id + 1


def watermark_of(record: BatchRecord | None) -> int:
    return record.watermark_ms if record is not None else NEG_INF_MS

