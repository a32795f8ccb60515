"""A keyed stream's per-key state, in files a batch writes only for the keys it touched.

Spark's group state holds one small value per bucket of keys: the names of the bucket's live files, its
earliest wake-up and how many keys it holds (``spark.keyed``). Each key's state bytes and wake-ups are rows
of those files (Parquet: the pickled key, the state, the event-time and processing-time wake-ups; a row
without state is a tombstone), newest file last. A row may hold part of the key's state and what the batch added
to it (the remembered ids and buffered elements of the keyed runtime: a key keeps thousands of ids and seconds of
elements, a batch adds a few), which the reader merges with the key's state before it. A bucket's call reads the rows of the keys it runs from
this process's view of the bucket (:class:`BucketView`) and writes one file with the rows that changed.
A bucket's files are merged as a log-structured store merges its runs, so that what a batch pays for them follows
what batches write, not what the bucket holds:

* a file is a **base** (the bucket's whole state, written by one call) or a **run** of a level: a call's own rows are
  a run of level 0, and once ``compact_after`` runs of one level end the list (a little more or less per bucket, so
  buckets do not all merge in the same batch) they are concatenated, rows in order, into one run of the next level;
* a bucket's first file is a base; once the runs after the base hold as many bytes as the base (give or take a
  quarter, by bucket), the call writes the bucket's whole state as a new base instead, and every older file is
  dropped. A bucket that grows by a batch's worth of keys at a time so writes its whole state after each doubling.

Each name says what the file is and its size (``<id>.b<bytes>.parquet``, ``<id>.r<level>-<bytes>.parquet``). Names
without them were written by an older lakestream: such a bucket is merged as that version merged it (its whole state
as one file once it has ``compact_after`` files), which gives it a base. A row is rewritten once per level and about
once per base: a bucket of 60k keys whose batches change 1k of them writes its whole state every ~60 batches, not
every ~16 (bench/HISTORY.md, 2026-12-01 late morning).

So a batch's cost follows the keys it touches, not the keys the stream remembers. Each Python worker keeps
the views it has built in memory (about 400 bytes per key beside its state bytes): a worker reads only the files it has not
read yet (in a running stream, usually none: it applied its own writes), and a worker that starts afresh
reads a bucket's live files once.

Crashes and replays: the file names travel in Spark's group state, which Spark versions with each batch,
so a replayed batch sees exactly the files the batch before it left (a file written by an attempt that did
not commit is never named). A view that does not hold exactly the named files, or whose last call did not
finish, is rebuilt from them. Files a call dropped are deleted once the next batch is recorded (the batch
record's ``removed``): a replay of the dropping batch still finds them.
"""

from __future__ import annotations

import heapq
import itertools
import pickle
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

COMPACT_AFTER = 16  # files per bucket before its state is written as one file
IDLE_SECONDS = 1800  # a view not used this long (its stream stopped) is dropped

Row = tuple  # (state, event-time wake-up ms or None, processing-time wake-up ms or None)
# A key's state from its state before a call (None: it had none), the part of it the call stored and what it added
Merge = Callable[[Any, bytes, bytes], Any]


@dataclass
class BucketView:
    """One bucket's keys as this process last applied its files."""

    files: list[str] = field(default_factory=list)
    rows: dict[Any, Row] = field(default_factory=dict)
    _wakes: list = field(default_factory=list)  # heap of (event-time wake-up, n, key); stale entries skipped
    _order: Any = field(default_factory=itertools.count)
    _taken: set = field(default_factory=set)  # keys :meth:`due` took off the heap in the current call
    busy: bool = False  # a call took the view and has not committed: rebuilt before the next use
    used: float = field(default_factory=time.monotonic)
    _live: set = field(default_factory=set)  # keys whose state is not bytes (see :func:`commit`)

    def _set(self, key, row: Row | None) -> None:
        before = self.rows.pop(key, None) if row is None else self.rows.get(key)
        if row is None:
            return
        self.rows[key] = row
        if not isinstance(row[0], bytes):
            self._live.add(key)
        if row[1] is not None and (before is None or before[1] != row[1] or key in self._taken):
            heapq.heappush(self._wakes, (row[1], next(self._order), key))

    def _current(self) -> tuple | None:
        """The earliest entry of the wake-up heap that is still a key's wake-up (stale ones dropped)."""
        heap = self._wakes
        while heap:
            wake, _, key = heap[0]
            row = self.rows.get(key)
            if row is not None and row[1] == wake:
                return heap[0]
            heapq.heappop(heap)
        return None

    def due(self, watermark_ms: int) -> list:
        """The keys whose event-time wake-up the watermark has reached (taken off the heap: the call that
        runs them sets their next one)."""
        found = []
        while (top := self._current()) is not None and top[0] <= watermark_ms:
            heapq.heappop(self._wakes)
            if top[2] not in self._taken:  # (a key gone and back with the same wake-up has two entries)
                self._taken.add(top[2])
                found.append(top[2])
        return found

    def earliest_wake(self) -> int | None:
        top = self._current()
        return None if top is None else top[0]

    def earliest_processing_wake(self) -> int | None:
        return min((r[2] for r in self.rows.values() if r[2] is not None), default=None)


_VIEWS: dict[tuple[str, Any], BucketView] = {}
_LOCK = threading.Lock()


def _filesystem(root: str, options: Mapping[str, Any]):
    import fsspec

    return fsspec.core.url_to_fs(root, **dict(options))


def _read(fs, path: str) -> list[tuple[Any, Row | None, bytes | None]]:
    """A file's rows: (key, row or None, what the call added to the key's state before, or None: the row is whole)."""
    import pyarrow.parquet as pq

    table = pq.read_table(path, filesystem=fs)
    keys, states, wakes, pwakes = (table.column(c).to_pylist() for c in ("k", "s", "w", "p"))
    added = table.column("a").to_pylist() if "a" in table.column_names else [None] * len(keys)
    return [(pickle.loads(k), None if s is None else (s, w, p), a) for k, s, w, p, a in zip(keys, states, wakes, pwakes, added)]


def view(root: str, bucket: Any, files: list[str], options: Mapping[str, Any],
         merge: Merge | None = None) -> BucketView:
    """This process's view of ``bucket`` holding exactly ``files`` (names under ``root/<bucket>``), in order,
    taken for one call: until :func:`commit` the view counts as changing (a call that fails leaves it to be
    rebuilt, whatever it had taken off its heap). ``merge``: a key's state from its state before a row that holds
    only part of it (see :func:`commit`)."""
    now = time.monotonic()
    with _LOCK:
        for stale in [k for k, v in _VIEWS.items() if now - v.used > IDLE_SECONDS]:
            del _VIEWS[stale]
        current = _VIEWS.get((root, bucket))
        if current is None or current.busy or current.files != files[:len(current.files)]:
            current = _VIEWS[(root, bucket)] = BucketView()
        current.used = now
    missing = files[len(current.files):]
    current.busy = True  # (a read that fails leaves it to be rebuilt: some of a file's rows may be in it)
    if missing:
        fs, base = _filesystem(f"{root}/{bucket}", options)
        for name in missing:
            try:
                found = _read(fs, f"{base}/{name}")
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"key state file {root}/{bucket}/{name}, named by the checkpoint, is missing: restore a savepoint "
                    "of the job (lakestream savepoint restore) or start it from a new checkpoint") from None
            for key, row, added in found:
                if added is not None and row is not None:
                    if merge is None:
                        raise ValueError(f"key state file {root}/{bucket}/{name} holds partial rows: a merge is needed")
                    before = current.rows.get(key)
                    row = (merge(before[0] if before else None, row[0], added), row[1], row[2])
                current._set(key, row)
            current.files.append(name)
    return current


def adopt(root: str, bucket: Any, rows: Mapping[Any, Row]) -> BucketView:
    """A view of a bucket whose state Spark's group state held whole (a checkpoint written before these
    files): every key is written to the bucket's first file by the call's :func:`commit`."""
    fresh = BucketView(busy=True)
    for key, row in rows.items():
        fresh._set(key, row)
    with _LOCK:
        _VIEWS[(root, bucket)] = fresh
    return fresh


def compact_after(bucket: Any, every: int | None = None) -> int:
    """Files a bucket keeps before it is merged: ``every`` (default ``COMPACT_AFTER``), give or take a quarter,
    by bucket."""
    every = COMPACT_AFTER if every is None else every
    spread = max(1, every // 2)
    return max(1, every - spread // 2 + int(bucket) % spread)


def commit(root: str, bucket: Any, current: BucketView, changed: Mapping[Any, tuple | None],
           options: Mapping[str, Any], *, whole: bool = False, every: int | None = None) -> list[str]:
    """Apply the rows of ``changed`` keys (None: the key is gone) to the view and write them as the bucket's
    next file, a run of level 0, merging runs as the module says; or, ``whole`` or once the runs outweigh the base,
    its whole state as one file, a base (a bucket left without keys keeps no file). Returns the names of the files
    dropped (the bucket's files are then ``current.files``).

    A changed row may carry a fourth value, what the file keeps of it: (part of the state, what the call added to
    the state before it), which a reader's ``merge`` (see :func:`view`) turns back into the state. A key with an
    event a second remembers thousands of ids: written whole, each batch that touches it would write them all.

    A state need not be bytes: a caller may keep a key's state as objects (any value ``bytes()`` turns into the
    state's bytes) for the key's next call. The view keeps such states only for the keys this call changed or
    merged: the others are turned into bytes here, so the objects held follow the batch, not the keys remembered."""
    for key in current._live.difference(changed):
        row = current.rows.get(key)
        if row is not None and not isinstance(row[0], bytes):
            current.rows[key] = (bytes(row[0]), *row[1:])
    current._live.clear()
    for key, row in changed.items():
        current._set(key, None if row is None else row[:3])
    current._taken.clear()
    dropped: list[str] = []
    if not current.rows or whole:
        dropped, current.files = current.files, []
        if current.rows:
            current.files.append(_put(root, bucket, _table(list(current.rows.items())), True, 0, options))
        current.busy = False
        return dropped
    files = current.files
    table = _table(list(changed.items())) if changed else None
    every_n = compact_after(bucket, every)
    base = _size(files[0]) if files and _level(files[0]) == "b" else None
    sizes = [_size(f) for f in (files[1:] if base is not None else files)]
    if table is not None:
        sizes.append(table.nbytes)
    if None in sizes:  # files an older lakestream named: merged as it merged them
        rewrite = len(sizes) >= every_n
    elif base is None:  # a bucket's first file is its base
        rewrite = True
    else:  # (the cap on files: a bound for a reader that starts afresh, not expected before the runs outweigh the base)
        # "as much as the base", give or take a quarter by bucket as ``compact_after`` is: buckets fill alike, and
        # would otherwise write their whole states in the same batch
        rewrite = sum(sizes) * (every or COMPACT_AFTER) >= base * every_n or len(sizes) >= 4 * max(2, every_n)
    if rewrite:
        dropped, current.files = list(files), [_put(root, bucket, _table(list(current.rows.items())), True, 0, options)]
    elif table is not None:
        per_level, level = max(2, every_n), 0
        while True:  # the trailing runs of a level, with this one ``per_level`` of them: one run of the next level
            n = 0
            while n < len(files) and _level(files[-1 - n]) == str(level):
                n += 1
            if n + 1 < per_level:
                files.append(_put(root, bucket, table, False, level, options))
                break
            merged = files[-n:]
            del files[-n:]
            table = _concatenated(root, bucket, merged, table, options)
            dropped.extend(merged)
            level += 1
    current.busy = False
    return dropped


_NAME = re.compile(r"\.(?:b(?P<base>\d+)|r(?P<level>\d+)-(?P<size>\d+))\.parquet$")


def _level(name: str) -> str:
    """A file's kind: ``b`` (a base) or its run's level as text (``0`` for names that do not say)."""
    m = _NAME.search(name)
    return "0" if m is None else "b" if m["base"] is not None else m["level"]


def _size(name: str) -> int | None:
    """A file's size in bytes (as Arrow holds its rows), as its name says (None: a name that does not say)."""
    m = _NAME.search(name)
    return None if m is None else int(m["base"] if m["base"] is not None else m["size"])


def _put(root: str, bucket: Any, table, base: bool, level: int, options: Mapping[str, Any]) -> str:
    """Write ``table`` as a new file of the bucket: a base, or a run of ``level`` (its name says which, and its size)."""
    import pyarrow.parquet as pq

    name = f"{uuid.uuid4().hex}.{f'b{table.nbytes}' if base else f'r{level}-{table.nbytes}'}.parquet"
    fs, folder = _filesystem(f"{root}/{bucket}", options)
    fs.makedirs(folder, exist_ok=True)
    pq.write_table(table, f"{folder}/{name}", filesystem=fs, compression="lz4")
    return name


def _concatenated(root: str, bucket: Any, names: list[str], last, options: Mapping[str, Any]):
    """The rows of the files ``names``, then those of the table ``last``, in their order, as one table (a reader
    applies a file's rows in turn)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, folder = _filesystem(f"{root}/{bucket}", options)
    tables = [*(pq.read_table(f"{folder}/{name}", filesystem=fs) for name in names), last]
    if any("a" in t.column_names for t in tables):
        tables = [t if "a" in t.column_names else t.append_column("a", pa.nulls(t.num_rows, pa.binary())) for t in tables]
    columns = tables[0].column_names
    return pa.concat_tables([t.select(columns) for t in tables]).combine_chunks()


def _table(rows: list[tuple[Any, Row | None]]):
    """Rows of a bucket's file: the pickled key, the state (or the part of it the file keeps), the wake-ups, and
    what the call added (``a``, when a row keeps part of its state)."""
    import pyarrow as pa

    stored = [r[3] if r is not None and len(r) > 3 else None for _, r in rows]
    columns = {
        "k": pa.array([pickle.dumps(k, protocol=pickle.HIGHEST_PROTOCOL) for k, _ in rows], pa.binary()),
        "s": pa.array([None if r is None else part[0] if part else as_bytes(r[0]) for (_, r), part in zip(rows, stored)],
                      pa.binary()),
        "w": pa.array([None if r is None else r[1] for _, r in rows], pa.int64()),
        "p": pa.array([None if r is None else r[2] for _, r in rows], pa.int64()),
    }
    if any(stored):
        columns["a"] = pa.array([part[1] if part else None for part in stored], pa.binary())
    return pa.table(columns)


def as_bytes(state) -> bytes:
    """A key's state as bytes (a state kept as objects is pickled)."""
    return state if isinstance(state, bytes) else bytes(state)


def path_of(root: str, bucket: Any, name: str) -> str:
    return f"{root}/{bucket}/{name}"


def forget(root: str | None = None) -> None:
    """Drop this process's views of ``root`` (all: None)."""
    with _LOCK:
        for key in [k for k in _VIEWS if root is None or k[0] == root]:
            del _VIEWS[key]
