"""What every sink does, whatever the table format: exactly-once commits keyed by batch.

A stream commits each micro-batch to each of its tables as one atomic commit carrying
``Commit(app_id, version)``: ``app_id`` is the stream's query id (plus a restore epoch after a
savepoint restore), ``version`` the batch id. A replayed batch recomputes the same rows, finds its
commit in the table (Iceberg: a snapshot summary entry in the current lineage; Delta: the
application transaction of ``app_id``) and skips it: **exactly-once per table**.

Write kinds:

* ``append`` — rows written once (closed windows without lateness, late events, quarantine,
  keyed outputs);
* ``upsert`` — rows with an ``_op`` column (``upsert``/``delete``) merged on ``keys`` (corrected
  windows, retracted sessions);
* ``replace_range`` — bounded twins: the rows whose ``column`` lies in ``[lo, hi)`` become exactly
  the given rows, atomically;
* ``insert_missing`` — quarantine rows from a backfill, inserted unless already present;
* ``delete_keys`` — delete the rows matching given keys (late rows a backfill has absorbed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence, TypeVar

from pyspark.sql import DataFrame
from pyspark.sql import types as T

from ...declaration import Table
from ...errors import SinkCommitError

COMMIT_KEY = "lakestream.commit"
WATERMARK_KEY = "lakestream.watermark-ms"
OP = "_op"
R = TypeVar("R")


@dataclass(frozen=True)
class Commit:
    app_id: str
    version: int
    properties: Mapping[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.app_id}:{self.version}"

    def summary(self) -> dict[str, str]:
        return {COMMIT_KEY: self.id, **{k: str(v) for k, v in self.properties.items()}}


class Sink(Protocol):
    table: Table
    format: str

    def location(self) -> str: ...
    def exists(self) -> bool: ...
    def ensure(self, schema: T.StructType, partition_column: str | None, comment: str,
               upserts: bool = False) -> None: ...
    def is_committed(self, commit: Commit) -> bool: ...
    def append(self, frame: DataFrame, commit: Commit, *, may_exist: bool = True, rows: int | None = None) -> bool: ...
    def upsert(self, frame: DataFrame, keys: Sequence[str], commit: Commit, *, may_exist: bool = True) -> bool: ...
    def replace_range(self, frame: DataFrame, column: str, lo_ms: int, hi_ms: int, properties: Mapping[str, str]) -> None: ...
    def insert_missing(self, frame: DataFrame, on: Sequence[str], properties: Mapping[str, str]) -> None: ...
    def delete_keys(self, frame: DataFrame, on: Sequence[str], properties: Mapping[str, str]) -> None: ...
    def version(self) -> int | None: ...
    def version_before(self, app_id: str, batch_id: int, flush_kept: bool = False) -> int | None: ...
    def has_version(self, version: int) -> bool: ...
    def expire(self, retention_ms: int) -> tuple[int, int]: ...
    def tag(self, version: int, name: str) -> bool: ...
    def untag(self, name: str) -> None: ...
    def rollback(self, version: int | None) -> None: ...
    def read(self) -> DataFrame: ...
    def delete_where(self, condition: str) -> None: ...


FLUSH = "~flush"  # commits of side rows outside a batch carry ``<app id>~flush:<batch>`` (``run.side``)


def later_batch(commit_id: str | None, app_id: str, batch_id: int, flush_kept: bool = False) -> bool:
    """Whether ``commit_id`` (``<app id>:<batch>``) is a commit of ``app_id`` for a batch after ``batch_id``. A commit
    of side rows outside a batch (``<app id>~flush:<batch>``) is after it when made after a later batch, or after
    this one while its record still keeps those rows (``flush_kept``: a commit that died before the record's
    rewrite)."""
    if not commit_id:
        return False
    for prefix, kept in ((app_id + ":", False), (app_id + FLUSH + ":", flush_kept)):
        if commit_id.startswith(prefix):
            rest = commit_id[len(prefix):]
            return rest.isdigit() and (int(rest) > batch_id or (kept and int(rest) == batch_id))
    return False


# Messages of commit conflicts with another writer (a backfill beside the stream): retried.
_CONFLICTS = ("CommitFailedException", "ValidationException", "Found conflicting files", "CommitConflict",
              "Transaction failed", "ConcurrentAppend", "ConcurrentDelete", "version already exists",
              # Iceberg's MERGE when another writer committed between its scan and its runtime filter
              "the table has been concurrently modified",
              # delta-rs (CommitFailedError): a commit that landed since the table was read (an append or a merge
              # after a backfill's overwrite of a day, a merge after an append), or changed its metadata
              "a concurrent transaction", "Metadata changed since last commit", "Concurrent transaction failed",
              "Protocol changed since last commit")


def is_conflict(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return any(marker in text for marker in _CONFLICTS)


def with_retries(table: Table, attempt: Callable[[], R], *, already: Callable[[], bool] | None = None,
                 tries: int = 6, pause_s: float = 0.5) -> R | None:
    """Run a commit, retrying when another writer's commit conflicts with it.

    ``already`` tells whether an earlier attempt did commit after all (then nothing is redone).
    A failure that is not a conflict is raised at once: a swallowed commit failure is data loss.
    """
    for n in range(1, tries + 1):
        try:
            return attempt()
        except Exception as exc:  # noqa: BLE001 - re-raised below unless it is a conflict
            if not is_conflict(exc):
                raise
            if n == tries:
                raise SinkCommitError(
                    f"{table.name}: commit still conflicts with another writer after {tries} attempts; nothing was "
                    "committed (a stream replays the batch, a backfill can be run again)"
                ) from exc
            if already is not None and already():
                return None
            time.sleep(pause_s * n)
    return None
