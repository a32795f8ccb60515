"""The one place that knows a job's checkpoint folder: Spark's logs and lakestream's own files.

Spark's part (written by Structured Streaming; read here, never written)::

    metadata                {"id": <query id>}
    offsets/N               "v1", batch metadata (batchWatermarkMs, batchTimestampMs, conf), one offset per source
    commits/N               "v1", {"nextBatchWatermarkMs": ...}: batch N is committed
    sources/<i>/N[.compact] file-source log: one JSON line per input file (path, timestamp, batchId)
    state/<op>/<partition>  state stores of Spark's stateful operators (keyed jobs)

lakestream's part (``lakestream/``)::

    batches/N.json          batch record: statistics, totals, watermarks, the job's shape, the store manifest
    store/N/                the incremental store's files written by batch N (remembered ids, window pieces)
    side/N/<table>/         side rows (late, quarantined) batch N kept here until its side tables' next commit
    keys/<bucket>/          a keyed stream's per-key state files (their names are in Spark's group state)
    running                 the process running the stream (pid, host, query id, start)
    stop-request            asks that process to stop after its current batch (stop-with-savepoint)
    epoch                   a restore epoch, so commits re-run after a savepoint restore get new ids
    forced.json             ranges a forced backfill wrote while the stream was stopped: the stream upserts there

Every reader goes through a ``Files`` object (``hadoopfs.HadoopFS`` from Spark, ``checkpoint.Tree`` without
a JVM): both offer ``read_text``, ``names`` and ``exists`` on paths relative to nothing (full paths here).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol

ENGINE = "lakestream"
_NUMBER = re.compile(r"^(\d+)$")
_SOURCE_LOG = re.compile(r"^(\d+)(\.compact)?$")


class Files(Protocol):
    def read_text(self, path: str) -> str: ...
    def names(self, path: str) -> list[str]: ...
    def exists(self, path: str) -> bool: ...


@dataclass(frozen=True)
class Layout:
    """Paths inside one job's checkpoint folder (``Layout("")``: paths relative to it)."""

    root: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", self.root.rstrip("/"))

    def _at(self, rel: str) -> str:
        return f"{self.root}/{rel}" if self.root else rel

    # -- Spark's logs ----------------------------------------------------------------------
    @property
    def metadata(self) -> str:
        return self._at("metadata")

    @property
    def offsets(self) -> str:
        return self._at("offsets")

    def offset(self, batch_id: int) -> str:
        return f"{self.offsets}/{batch_id}"

    @property
    def commits(self) -> str:
        return self._at("commits")

    def commit(self, batch_id: int) -> str:
        return f"{self.commits}/{batch_id}"

    @property
    def sources(self) -> str:
        return self._at("sources")

    @property
    def state(self) -> str:
        return self._at("state")

    # -- lakestream's files ------------------------------------------------------------------
    @property
    def engine(self) -> str:
        return self._at(ENGINE)

    @property
    def batches(self) -> str:
        return f"{self.engine}/batches"

    def record(self, batch_id: int) -> str:
        return f"{self.batches}/{batch_id}.json"

    @property
    def store(self) -> str:
        return f"{self.engine}/store"

    def store_batch(self, batch_id: int) -> str:
        return f"{self.store}/{batch_id}"

    def side(self, batch_id: int, table: str) -> str:
        """Side rows of ``table`` that batch ``batch_id`` keeps until they are committed (``run.side``)."""
        return f"{self.engine}/side/{batch_id}/{table}"

    @property
    def keys(self) -> str:
        """A keyed stream's per-key state files, a folder per bucket (``keyed.files``)."""
        return f"{self.engine}/keys"

    @property
    def running(self) -> str:
        return f"{self.engine}/running"

    @property
    def stop_request(self) -> str:
        return f"{self.engine}/stop-request"

    @property
    def epoch(self) -> str:
        return f"{self.engine}/epoch"

    @property
    def forced(self) -> str:
        """Ranges of window starts a forced backfill wrote while the stream was stopped (see ``records``)."""
        return f"{self.engine}/forced.json"

    def legacy(self) -> list[str]:
        """Folders of engine-state formats before the incremental store (refused, see ``records``)."""
        return [f"{self.engine}/windows", f"{self.engine}/seen"]


# -- reading Spark's logs (pure text) ----------------------------------------------------------

def numbered(names: list[str]) -> list[int]:
    """Batch numbers among folder entries (``0``, ``1``...), sorted."""
    return sorted(int(m.group(1)) for n in names if (m := _NUMBER.match(n)))


def log_lines(text: str, where: str) -> list[str]:
    """The lines of a Spark metadata-log file after its version line (ValueError when damaged)."""
    lines = text.split("\n")
    if not lines or not re.fullmatch(r"v\d+", lines[0].strip()):
        raise ValueError(f"{where} is corrupt: no version line (got {text[:30]!r})")
    return [line for line in lines[1:] if line.strip()]


def query_id(text: str, where: str = "metadata") -> str:
    try:
        return json.loads(text.splitlines()[0])["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"{where} is corrupt: no query id") from None


def offset_metadata(text: str, where: str) -> dict:
    """The batch metadata of an offset-log entry (watermark, batch timestamp, conf)."""
    lines = log_lines(text, where)
    try:
        meta = json.loads(lines[0])
    except (ValueError, IndexError):
        raise ValueError(f"{where} is corrupt: invalid batch metadata") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{where} is corrupt: batch metadata is not an object")
    return meta


def offset_sources(text: str, where: str) -> list:
    """The per-source offsets of an offset-log entry (None for a source without one)."""
    return [json.loads(line) if line.strip() not in ("", "-") else None for line in log_lines(text, where)[1:]]


def shuffle_partitions(meta: dict) -> int | None:
    value = meta.get("conf", {}).get("spark.sql.shuffle.partitions")
    return int(value) if str(value).isdigit() else None


def commit_watermark(text: str, where: str) -> int | None:
    """``nextBatchWatermarkMs`` of a commit-log entry (the watermark after that batch)."""
    lines = log_lines(text, where)
    if not lines:
        raise ValueError(f"{where} is corrupt: empty")
    try:
        value = json.loads(lines[0]).get("nextBatchWatermarkMs")
    except (ValueError, AttributeError):
        raise ValueError(f"{where} is corrupt: invalid JSON {lines[0][:40]!r}") from None
    return int(value) if value is not None else None


def source_log_files(names: list[str]) -> list[str]:
    """The source-log files a reader needs, in order: the newest compaction and what follows it."""
    found = {int(m.group(1)): m.group(0) for n in names if (m := _SOURCE_LOG.match(n))}
    compacts = [b for b, name in found.items() if name.endswith(".compact")]
    start = max(compacts) if compacts else min(found, default=0)
    return [found[b] for b in sorted(found) if b >= start]


@dataclass(frozen=True)
class SourceFile:
    path: str  # as Spark names it (a URI)
    modified_ms: int  # the file's modification time when Spark listed it
    batch_id: int


def source_log_entries(text: str, where: str, default_batch: int) -> list[SourceFile]:
    out = []
    for line in log_lines(text, where):
        try:
            entry = json.loads(line)
        except ValueError:
            raise ValueError(f"{where} is corrupt: invalid JSON {line[:40]!r}") from None
        if not isinstance(entry, dict) or "path" not in entry:
            raise ValueError(f"{where} is corrupt: an entry without a path")
        out.append(SourceFile(entry["path"], int(entry.get("timestamp", 0)), int(entry.get("batchId", default_batch))))
    return out


# -- what a checkpoint says about the next batch (read once when a stream starts) ---------------

def last_planned_and_committed(files: Files, layout: Layout) -> tuple[int | None, int | None]:
    planned = numbered(files.names(layout.offsets))
    committed = numbered(files.names(layout.commits))
    return (planned[-1] if planned else None), (committed[-1] if committed else None)


def committed_offsets(files: Files, layout: Layout) -> list | None:
    """The per-source offsets of the last committed batch (None: nothing committed)."""
    _, committed = last_planned_and_committed(files, layout)
    if committed is None:
        return None
    path = layout.offset(committed)
    return offset_sources(files.read_text(path), path)


def commit_app_id(files: Files, layout: Layout) -> str:
    """The app id the stream of a checkpoint commits with: its query id, and its restore epoch if any."""
    qid = query_id(files.read_text(layout.metadata))
    epoch = files.read_text(layout.epoch).strip() if files.exists(layout.epoch) else ""
    return f"{qid}:{epoch}" if epoch else qid
