"""The incremental store of a windowed stream's state, inside its checkpoint: Parquet files written
only for what changed, read only for what a batch needs.

Three kinds of rows, each batch writing one folder ``lakestream/store/<batch>/<kind>``:

* ``ids`` — remembered event ids: two 64-bit hashes of the dedup key, its event-time bucket (one
  second; informational) and when it is forgotten (``expires_ms = max(event time, W_in) + dedup_ttl``).
  A batch looks its ids up whatever their event time (a re-delivery may carry another one) in an
  in-memory index of the live files on the executors (``seen``): it costs what the batch brings, not
  a read of every remembered id. A file is dropped whole once every id in it has expired. A large batch
  whose store remembers no ids writes its file from its statistics job (``write_ids_now``), with one more
  column, ``_kept`` (the line kept of an id delivered more than once); every reader selects its columns by name.
* ``pieces`` — partial aggregates of the on-time events of one batch per window (sessions: per
  merged interval). A window's value is the combination of its pieces; a batch reads the pieces of
  the windows that fire or are corrected, nothing else.
* ``evals`` — session windows only: the content and the having verdict of a session when it was
  last evaluated, so merges retract exactly the rows that are in the sink.

The manifest (the list of live files with their bucket/time ranges) travels in the batch record
(``records``), so a replayed batch starts from exactly the files its predecessor saw. Files dropped by
batch N are deleted once batch N+1 has committed (a replay of N may still read them before).
Small files are merged every ``COMPACT_EVERY`` files of a kind.
"""

from __future__ import annotations

import itertools
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import pyarrow as pa
from pyspark.sql import DataFrame, Observation
from pyspark.sql import functions as F
from pyspark.sql import types as T

from ..spark.columns import as_param, once, param, select
from ..spark.metrics import observe, observed, packed
from .layout import Layout

_WRITES = itertools.count()
BUCKET_MS = 1_000  # event-time bucket of remembered ids
LEGACY_BUCKET_MS = 60_000  # of files that do not say (written before buckets were a second)
COMPACT_EVERY = 24  # merge the files of a kind once there are this many
KINDS = ("ids", "pieces", "evals")

IDS_SCHEMA = T.StructType([
    T.StructField("_b", T.LongType()),  # event-time bucket
    T.StructField("_h1", T.LongType()),
    T.StructField("_h2", T.LongType()),
    T.StructField("_expires_ms", T.LongType()),
])


@dataclass(frozen=True)
class StoreFile:
    path: str
    kind: str
    batch: int
    rows: int
    lo: int  # ids: first bucket; pieces/evals: earliest window start (ms)
    hi: int  # ids: last bucket; pieces/evals: latest window end (ms)
    expires_ms: int  # ids: the last expiry; pieces/evals: latest window end (eviction adds the lateness)
    buckets: tuple[int, ...] = ()  # ids written before 2026-11-27: every bucket in the file
    bucket_ms: int = LEGACY_BUCKET_MS  # ids: the width of its buckets
    token: str = ""  # unique per write: a file rewritten at the same path (a replayed batch) is another file

    @property
    def identity(self) -> str:
        return self.token or f"{self.path}#{self.batch}#{self.rows}#{self.expires_ms}"

    @staticmethod
    def of(data: dict) -> "StoreFile":
        return StoreFile(**{**data, "buckets": tuple(data.get("buckets") or ())})


@dataclass
class Manifest:
    files: list[StoreFile] = field(default_factory=list)

    def of_kind(self, kind: str) -> list[StoreFile]:
        return [f for f in self.files if f.kind == kind]

    def rows(self) -> dict[str, int]:
        return {k: sum(f.rows for f in self.of_kind(k)) for k in KINDS}

    def to_json(self) -> list[dict]:
        return [{**asdict(f), "buckets": list(f.buckets)} for f in self.files]

    @staticmethod
    def from_json(data: list | None) -> "Manifest":
        return Manifest([StoreFile.of(d) for d in data or []])


def id_hashes(key: F.Column) -> list[F.Column]:
    """Two independent 64-bit hashes of the dedup key (a collision of both needs ~2^64 ids)."""
    text = key.cast("string")
    return [F.xxhash64(text).alias("_h1"), F.xxhash64(F.concat(text, F.lit("\u0001lakestream"))).alias("_h2")]


def bucket_of(t_ms: F.Column) -> F.Column:
    return F.floor(t_ms / F.lit(BUCKET_MS)).cast("long")


class Store:
    """Read and write one stream's store (on Spark: files are read and written by executors; a small batch's ids,
    which its driver holds already, are written by the driver)."""

    def __init__(self, spark, layout: Layout, manifest: Manifest | None, schemas: dict[str, T.StructType],
                 storage_options: Mapping[str, Any] | None = None):
        self.spark = spark
        self.layout = layout
        self.manifest = manifest or Manifest()
        self.schemas = {"ids": IDS_SCHEMA, **schemas}
        self.storage_options = dict(storage_options or {})  # (for the executors' index of the ids: fsspec)

    # -- reading --------------------------------------------------------------------------
    def read(self, kind: str, files: list[StoreFile]) -> DataFrame | None:
        if not files:
            return None
        return self.spark.read.schema(self.schemas[kind]).parquet(*[f.path for f in files])

    def read_table(self, kind: str, files: list[StoreFile]) -> pa.Table | None:
        """The rows of ``files`` (of ``kind``), read by the driver as ``seen`` reads the ids (``seen.read_parts``): for
        files small enough to merge without a Spark job (None: no rows)."""
        from .seen import read_parts

        tables = [t for f in files if (t := read_parts(f.path, self.schemas[kind].names, self.storage_options)) is not None]
        return pa.concat_tables(tables, promote_options="default") if tables else None

    def id_files(self) -> list[tuple[str, str]]:
        """The live ids files: (identity, path) pairs, what ``seen.lookup`` indexes."""
        return [(f.identity, f.path) for f in self.manifest.of_kind("ids")]

    def in_range(self, kind: str, lo_ms: int, hi_ms: int) -> DataFrame | None:
        """Rows of ``kind`` whose window starts in ``[lo_ms, hi_ms]``."""
        files = [f for f in self.manifest.of_kind(kind) if f.lo <= hi_ms and f.hi >= lo_ms]
        frame = self.read(kind, files)
        return None if frame is None else frame.where((as_param(F.col("ws")) >= param(lo_ms)) & (as_param(F.col("ws")) <= param(hi_ms)))

    def ending_in(self, kind: str, lo_ms: int, hi_ms: int) -> DataFrame | None:
        """Rows of ``kind`` whose window ends in ``(lo_ms, hi_ms]``."""
        files = [f for f in self.manifest.of_kind(kind) if f.expires_ms > lo_ms and f.lo <= hi_ms]
        frame = self.read(kind, files)
        return None if frame is None else frame.where((as_param(F.col("we")) > param(lo_ms)) & (as_param(F.col("we")) <= param(hi_ms)))

    def every(self, kind: str) -> DataFrame | None:
        return self.read(kind, self.manifest.of_kind(kind))

    # -- writing --------------------------------------------------------------------------
    def write(self, batch_id: int, frames: dict[str, DataFrame], folder: str | None = None,
              collect: tuple[str, ...] = ()) -> list[StoreFile]:
        """Write the frames of every kind as ``<folder>/<kind>`` (default ``store/<batch>``; a replay of
        the batch replaces the folder), one concurrent Spark job per kind: small batches are bound by
        per-job latency, which concurrent jobs overlap. A kind given as an Arrow table (rows the driver
        holds) is written without a job. A kind in ``collect`` (a tumbling or sliding stream's pieces: a row per
        key and window the batch touched) is brought to the driver when it has at most ``COLLECTED_ROWS`` rows and
        written from there: its Spark job computes it and returns it, with no files and no commit protocol on
        the executors (a larger one is written by Spark). Returns the new files; a kind without rows writes
        nothing."""
        from ..spark.hadoopfs import HadoopFS

        base = folder or self.layout.store_batch(batch_id)
        frames = {k: v for k, v in frames.items() if v is not None}
        written = [v for v in frames.values() if isinstance(v, StoreFile)]  # (by ``write_ids_now``)
        frames = {k: v for k, v in frames.items() if not isinstance(v, StoreFile)}
        if not frames:
            return written
        if not written:
            HadoopFS(self.spark).delete(base)  # a replayed batch starts from nothing
        if len(frames) == 1:
            kind, frame = next(iter(frames.items()))
            made = [self._write_kind(batch_id, base, kind, frame, kind in collect)]
        else:
            with ThreadPoolExecutor(max_workers=len(frames), thread_name_prefix="store") as pool:
                made = [f.result() for f in [pool.submit(self._write_kind, batch_id, base, k, v, k in collect)
                                             for k, v in frames.items()]]
        return [*written, *[f for f in made if f is not None]]

    def write_ids_now(self, batch_id: int, frame: DataFrame, kept: str, max_repeats: int
                      ) -> tuple[StoreFile | None, tuple[list[int], list[int], list[int]] | None]:
        """Write a batch's ids file before the rest of its store (:meth:`write` then keeps it): ``frame`` has the ids
        columns and ``kept``, the line kept of an id delivered more than once (NULL for the others). Returns the file
        and the repeated ids (``_h1``, ``_h2``, ``kept``; None when more than ``max_repeats``), read back from it."""
        from ..spark.hadoopfs import HadoopFS

        base = self.layout.store_batch(batch_id)
        HadoopFS(self.spark).delete(base)  # a replayed batch starts from nothing
        made, got = self._write_frame(batch_id, base, "ids", frame, kept)
        repeats = int(got.get("kept") or 0)
        if not repeats:
            return made, ([], [], [])
        if repeats > max_repeats:
            return made, None
        import fsspec
        import pyarrow.dataset as ds

        fs, root = fsspec.core.url_to_fs(made.path, **self.storage_options)
        table = ds.dataset(root, filesystem=fs, format="parquet").to_table(
            columns=["_h1", "_h2", kept], filter=ds.field(kept).is_valid())
        return made, tuple(table.column(c).to_pylist() for c in ("_h1", "_h2", kept))

    def _write_kind(self, batch_id: int, base: str, kind: str, frame: DataFrame | pa.Table,
                    collect: bool = False) -> StoreFile | None:
        if isinstance(frame, pa.Table):
            return self._write_table(batch_id, base, kind, frame)
        if collect:
            table = self._collected(kind, frame)
            if table is not None:
                return self._write_table(batch_id, base, kind, table)
        return self._write_frame(batch_id, base, kind, frame)[0]

    def _collected(self, kind: str, frame: DataFrame) -> pa.Table | None:
        """``frame``'s rows of ``kind`` on the driver, when there are at most ``COLLECTED_ROWS`` (else None)."""
        from ..spark.jvm import collect_arrow

        schema = self.schemas[kind]
        columns = once(("store collect", kind, tuple(schema.names)), lambda: [F.col(n) for n in schema.names])
        got = collect_arrow(select(frame, columns).limit(COLLECTED_ROWS + 1))
        table = pa.Table.from_batches(got) if got else pa.table({})  # (no rows: nothing to write)
        return table if table.num_rows <= COLLECTED_ROWS else None

    def _write_frame(self, batch_id: int, base: str, kind: str, frame: DataFrame, kept: str | None = None
                     ) -> tuple[StoreFile | None, dict]:
        """Write ``frame``'s columns of ``kind`` (and ``kept``, counted where not NULL as the metric ``kept``) by a
        Spark job: the file (None: no rows) and the write's metrics."""
        names = [*self.schemas[kind].names, *([kept] if kept else [])]
        columns, metrics = once(("store write", kind, tuple(names)), lambda: (
            [F.col(n) for n in names],
            packed(_write_metrics(kind) + ([F.count(F.col(kept)).alias("kept")] if kept else []))))
        path = f"{base}/{kind}"
        observation = Observation(f"store-{batch_id}-{kind}-{next(_WRITES)}")
        observe(select(frame, columns), observation, metrics).write.mode("overwrite").parquet(path)
        got = observed(observation)
        if not got.get("rows"):
            return None, got
        return StoreFile(
            path=path, kind=kind, batch=batch_id, rows=int(got["rows"]), lo=int(got["lo"]), hi=int(got["hi"]),
            expires_ms=int(got["expires"]), bucket_ms=BUCKET_MS, token=uuid.uuid4().hex,
        ), got

    def _write_table(self, batch_id: int, base: str, kind: str, table: pa.Table) -> StoreFile | None:
        """Rows the driver holds (a small batch's ids: ``WindowedBatch.new_ids``), written as Spark would write them,
        one Parquet part in ``<base>/<kind>``, with no Spark job (through fsspec, as ``seen`` reads the ids)."""
        import fsspec
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        if not table.num_rows:
            return None
        path = f"{base}/{kind}"
        token = uuid.uuid4().hex
        fs, root = fsspec.core.url_to_fs(path, **self.storage_options)
        fs.makedirs(root, exist_ok=True)
        pq.write_table(table.select(self.schemas[kind].names), f"{root}/part-00000-{token}.zstd.parquet", filesystem=fs,
                       compression="zstd")
        lo, hi, expires = _bounds(kind)
        return StoreFile(
            path=path, kind=kind, batch=batch_id, rows=table.num_rows, lo=int(pc.min(table[lo]).as_py()),
            hi=int(pc.max(table[hi]).as_py()), expires_ms=int(pc.max(table[expires]).as_py()), bucket_ms=BUCKET_MS,
            token=token,
        )


# A batch's pieces of at most this many rows are written from the driver (``Store.write``'s ``collect``): a few MB
# as Arrow. One file per trigger over 1M payments (~1,500 pieces a batch): the store's step 0.2 s a run against 0.6-0.8 s.
COLLECTED_ROWS = 50_000


def _bounds(kind: str) -> tuple[str, str, str]:
    """The columns of a file's ``lo``, ``hi`` and ``expires_ms`` (see :class:`StoreFile`)."""
    return ("_b", "_b", "_expires_ms") if kind == "ids" else ("ws", "we", "we")


def _write_metrics(kind: str) -> list[F.Column]:
    lo, hi, expires = _bounds(kind)
    return [F.count(F.lit(1)).alias("rows"), F.min(lo).alias("lo"), F.max(hi).alias("hi"),
            F.max(expires).alias("expires")]
