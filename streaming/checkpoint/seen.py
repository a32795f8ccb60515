"""Remembered ids looked up by id, whatever the event time of the delivery that asks.

A windowed stream remembers the ids it has counted in the store's ``ids`` files (``store``: one file per
batch, merged every ``COMPACT_EVERY``; an id is forgotten at ``max(event time, W_in) + dedup_ttl``). A
re-delivery may carry another event time than the first delivery (a producer that stamps its retries), so
a batch asks, for each of its ids, whether *any* live file holds it, unexpired.

Asking that of Parquet files would read every remembered id in every batch. Instead, each Python worker
keeps the files it has read in memory, sorted by the first of the id's two hashes (:class:`Index`, runs
of geometric sizes): a batch costs a binary search per id and run (about log2 of the live ids over a
batch's), and reading the files this worker has not read yet — in a running stream, its predecessor's,
about a batch of ids. Files are immutable (each has a token in the
manifest; a replayed batch's file has a new one), and the manifest names the live ones: entries of files
no longer live (merged into another, expired, or written by a batch a restore rolled back) are ignored,
and dropped once they are as many as the live ones. A worker's memory is about 32 bytes per live id
(``dedup_ttl`` times the event rate); a worker that starts afresh reads the live files once.

Runs on the executors (``mapInPandas``), so nothing is collected to the driver but the remembered ids of
the batch; or, for a batch of ordinary size, on the driver over the batch's hashes (:func:`remembered_on_driver`:
one Python task less in the batch's statistics job). Each store (checkpoint) has its own index per process; an
index not asked for ``IDLE_SECONDS`` is dropped.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np

from ..spark import pyworkers

IDLE_SECONDS = 1800  # an index not asked for this long (its stream stopped) is dropped
SEEN_SCHEMA = "_h1 long, _h2 long"


@dataclass
class Run:
    """Entries sorted by ``h1``: the id's hashes, when it is forgotten, and the number of its file."""

    h1: np.ndarray
    h2: np.ndarray
    expires: np.ndarray
    file: np.ndarray

    @staticmethod
    def of(h1, h2, expires, file_no: int) -> "Run":
        order = np.argsort(h1, kind="stable")
        return Run(h1[order], h2[order], expires[order], np.full(len(order), file_no, dtype=np.int32))

    @staticmethod
    def merged(runs: list["Run"], keep: Callable[["Run"], np.ndarray] | None = None) -> "Run":
        parts = [r if keep is None else r.select(keep(r)) for r in runs]
        h1 = np.concatenate([r.h1 for r in parts]) if parts else np.empty(0, np.int64)
        order = np.argsort(h1, kind="stable")  # (sorted runs: a merge, not a full sort)
        cat = (lambda name, dtype: np.concatenate([getattr(r, name) for r in parts])[order] if parts
               else np.empty(0, dtype))
        return Run(h1[order], cat("h2", np.int64), cat("expires", np.int64), cat("file", np.int32))

    def select(self, mask: np.ndarray) -> "Run":
        return Run(self.h1[mask], self.h2[mask], self.expires[mask], self.file[mask])

    def __len__(self) -> int:
        return len(self.h1)


@dataclass
class Index:
    """The remembered ids of one store that this process has read."""

    runs: list[Run] = field(default_factory=list)
    numbers: dict[str, int] = field(default_factory=dict)  # file token -> its number in the entries
    sizes: dict[int, int] = field(default_factory=dict)  # file number -> entries
    next_number: int = 0
    used: float = field(default_factory=time.monotonic)

    def update(self, files: Iterable[tuple[str, str]], read: Callable[[str], tuple[np.ndarray, ...]]) -> set[int]:
        """Make the index hold every file of ``files`` ((token, path) pairs, the manifest's live ids files),
        reading those it lacks; returns their numbers."""
        live = set()
        for token, path in files:
            number = self.numbers.get(token)
            if number is None:
                number = self.next_number
                self.next_number += 1
                h1, h2, expires = read(path)
                self.runs.append(Run.of(h1, h2, expires, number))
                # Runs of geometric sizes, like a binary counter: a new run merges with the previous one
                # while that one is not larger, so an entry is merged about log2(entries / batch) times and
                # a lookup searches about as many runs.
                while len(self.runs) > 1 and len(self.runs[-2]) <= len(self.runs[-1]):
                    self.runs[-2:] = [Run.merged(self.runs[-2:])]
                self.numbers[token] = number
                self.sizes[number] = len(h1)
            live.add(number)
        dead = sum(n for f, n in self.sizes.items() if f not in live)
        if dead and dead >= sum(self.sizes[f] for f in live):  # as many dead entries as live ones: drop them
            wanted = np.fromiter(live, dtype=np.int32)
            self.runs = [Run.merged(self.runs, lambda r: np.isin(r.file, wanted))]
            self.sizes = {f: n for f, n in self.sizes.items() if f in live}
            self.numbers = {t: f for t, f in self.numbers.items() if f in live}
        self.used = time.monotonic()
        return live

    def remembered(self, h1: np.ndarray, h2: np.ndarray, watermark_ms: int, live: set[int]) -> np.ndarray:
        """Whether each id (``h1[i], h2[i]``) is held by a live file and not forgotten at ``watermark_ms``."""
        found = np.zeros(len(h1), dtype=bool)
        if not len(h1):
            return found
        alive = np.fromiter(live, dtype=np.int32, count=len(live))
        order = np.argsort(h1, kind="stable")  # (searching in order: each search starts near the last)
        h1, h2 = h1[order], h2[order]
        hit_sorted = np.zeros(len(h1), dtype=bool)
        for run in self.runs:
            n = len(run)
            if not n:
                continue
            lo = np.searchsorted(run.h1, h1, side="left")
            at = np.minimum(lo, n - 1)
            hit = np.flatnonzero((run.h1[at] == h1) & ~hit_sorted)  # (equal first hashes: re-deliveries, collisions)
            if not len(hit):
                continue
            at = at[hit]
            ok = (run.h2[at] == h2[hit]) & (run.expires[at] > watermark_ms) & np.isin(run.file[at], alive)
            hit_sorted[hit[ok]] = True
            for i in hit[~ok]:  # the first hash more than once: the id in several files, or a collision
                j = lo[i] + 1
                while j < n and run.h1[j] == h1[i]:
                    if run.h2[j] == h2[i] and run.expires[j] > watermark_ms and int(run.file[j]) in live:
                        hit_sorted[i] = True
                        break
                    j += 1
        found[order] = hit_sorted
        return found

    @property
    def entries(self) -> int:
        return sum(len(r) for r in self.runs)


_INDEXES: dict[str, Index] = {}
_LOCK = threading.Lock()  # (one task at a time per Python worker; the lock is for tests that call in threads)


def index_for(store: str) -> Index:
    now = time.monotonic()
    for key in [k for k, ix in _INDEXES.items() if k != store and now - ix.used > IDLE_SECONDS]:
        del _INDEXES[key]
    return _INDEXES.setdefault(store, Index())


def forget(store: str | None = None) -> None:
    """Drop this process's index of ``store`` (all: None)."""
    if store is None:
        _INDEXES.clear()
    else:
        _INDEXES.pop(store, None)


def read_parts(path: str, columns: list[str], storage_options: Mapping[str, Any]):
    """``columns`` of a store file (a folder of Parquet parts, as Spark writes it) as one Arrow table, read by the
    driver or a Python worker through fsspec with no Spark job (None: no part)."""
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, root = fsspec.core.url_to_fs(path, **dict(storage_options))
    parts = sorted(p for p in fs.ls(root, detail=False) if p.rsplit("/", 1)[-1].endswith(".parquet"))
    tables = [pq.read_table(p, columns=columns, filesystem=fs) for p in parts]
    return pa.concat_tables(tables, promote_options="default") if tables else None


def read_ids(path: str, storage_options: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The hashes and expiries in an ids file (a folder of Parquet parts, as Spark writes it)."""
    table = read_parts(path, ["_h1", "_h2", "_expires_ms"], storage_options)
    if table is None:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    return tuple(table.column(c).to_numpy().astype(np.int64, copy=False) for c in ("_h1", "_h2", "_expires_ms"))


def remembered_on_driver(store: str, files: list[tuple[str, str]], watermark_ms: int, storage_options: Mapping[str, Any],
                         h1: np.ndarray, h2: np.ndarray) -> np.ndarray:
    """Whether each id is remembered, looked up in this (the driver's) process's index of ``store``: for a batch
    whose ids' hashes are few enough to come to the driver (the same index and answer as :func:`lookup`'s)."""
    with _LOCK:
        index = index_for(f"driver:{store}")
        live = index.update(files, lambda path: read_ids(path, storage_options))
        return index.remembered(h1, h2, int(watermark_ms), live)


def lookup(store: str, files: list[tuple[str, str]], watermark_ms: int, storage_options: Mapping[str, Any]):
    """The ``mapInPandas`` function over a batch's ids (``_h1``, ``_h2``) that yields those remembered (a
    module function with its arguments bound: Spark pickles it by reference, not this module's state)."""
    return functools.partial(_remembered, store, list(files), int(watermark_ms), dict(storage_options))


def _remembered(store: str, files: list[tuple[str, str]], watermark_ms: int, options: dict,
                batches: Iterator) -> Iterator:
    import pandas as pd

    pyworkers.prepare()
    with _LOCK:
        index = index_for(store)
        live = index.update(files, lambda path: read_ids(path, options))
        for batch in batches:
            h1 = batch["_h1"].to_numpy(dtype=np.int64)
            h2 = batch["_h2"].to_numpy(dtype=np.int64)
            found = index.remembered(h1, h2, watermark_ms, live)
            if found.any():
                yield pd.DataFrame({"_h1": h1[found], "_h2": h2[found]})
