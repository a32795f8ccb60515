"""The incremental store of a windowed stream's state, inside its checkpoint: Parquet files written
only for what changed, read only for what a batch needs.

Three kinds of rows, each batch writing one folder ``lakestream/store/<batch>/<kind>``:

* ``ids`` — remembered event ids: two 64-bit hashes of the dedup key, its event-time bucket (one
  second; files written before 2026-11-25 have one-minute buckets, each file says which) and when
  it is forgotten (``expires_ms = max(event time, W_in) + dedup_ttl``). A batch reads only the ids
  in the buckets of its own events (a re-delivery has the event time of the original), so the
  cost of deduplication follows the batch, not the number of remembered ids (with one-minute
  buckets a live stream read up to a minute of ids per batch: 180k rows at 5k events/s); a file is
  dropped whole once every id in it has expired.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import reduce

from pyspark.sql import DataFrame, Observation
from pyspark.sql import functions as F
from pyspark.sql import types as T

from ..spark.columns import as_param, one_of, once, param, select
from ..spark.metrics import observe, observed, packed
from .layout import Layout

_WRITES = itertools.count()
BUCKET_MS = 1_000  # event-time bucket of remembered ids
LEGACY_BUCKET_MS = 60_000  # of files that do not say (written before buckets were a second)
MAX_BUCKETS = 4096  # a batch spanning more seconds of event time looks its ids up in every file
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
    buckets: tuple[int, ...] = ()  # ids: every bucket in the file (exact pruning)
    bucket_ms: int = LEGACY_BUCKET_MS  # ids: the width of its buckets

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
    """Read and write one stream's store (all on Spark: files are read and written by executors)."""

    def __init__(self, spark, layout: Layout, manifest: Manifest | None, schemas: dict[str, T.StructType]):
        self.spark = spark
        self.layout = layout
        self.manifest = manifest or Manifest()
        self.schemas = {"ids": IDS_SCHEMA, **schemas}

    # -- reading --------------------------------------------------------------------------
    def read(self, kind: str, files: list[StoreFile]) -> DataFrame | None:
        if not files:
            return None
        return self.spark.read.schema(self.schemas[kind]).parquet(*[f.path for f in files])

    def ids(self, buckets: set[int] | None) -> DataFrame | None:
        """Remembered ids whose event-time bucket is one of ``buckets`` (``BUCKET_MS`` wide; None: all)."""
        files = self.manifest.of_kind("ids")
        if buckets is None:
            return self.read("ids", files)
        frames = []
        for width in sorted({f.bucket_ms for f in files}):
            wanted = {b * BUCKET_MS // width for b in buckets}  # (floor(floor(t / 1 s) / 60) = floor(t / 1 min))
            frame = self.read("ids", [f for f in files if f.bucket_ms == width and wanted.intersection(f.buckets)])
            if frame is not None:
                frames.append(frame.where(one_of(F.col("_b"), sorted(wanted))))
        return reduce(DataFrame.unionAll, frames) if frames else None

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
    def write(self, batch_id: int, frames: dict[str, DataFrame], folder: str | None = None) -> list[StoreFile]:
        """Write the frames of every kind as ``<folder>/<kind>`` (default ``store/<batch>``; a replay of
        the batch replaces the folder), one concurrent Spark job per kind: small batches are bound by
        per-job latency, which concurrent jobs overlap. Returns the new files; a kind without rows
        writes nothing."""
        from ..spark.hadoopfs import HadoopFS

        base = folder or self.layout.store_batch(batch_id)
        frames = {k: v for k, v in frames.items() if v is not None}
        if not frames:
            return []
        HadoopFS(self.spark).delete(base)  # a replayed batch starts from nothing
        if len(frames) == 1:
            made = [self._write_kind(batch_id, base, *next(iter(frames.items())))]
        else:
            with ThreadPoolExecutor(max_workers=len(frames), thread_name_prefix="store") as pool:
                made = [f.result() for f in [pool.submit(self._write_kind, batch_id, base, k, v) for k, v in frames.items()]]
        return [f for f in made if f is not None]

    def _write_kind(self, batch_id: int, base: str, kind: str, frame: DataFrame) -> StoreFile | None:
        names = self.schemas[kind].names
        columns, metrics = once(("store write", kind, tuple(names)), lambda: (
            [F.col(n) for n in names], packed(_write_metrics(kind))))
        path = f"{base}/{kind}"
        observation = Observation(f"store-{batch_id}-{kind}-{next(_WRITES)}")
        observe(select(frame, columns), observation, metrics).write.mode("overwrite").parquet(path)
        got = observed(observation)
        if not got.get("rows"):
            return None
        return StoreFile(
            path=path, kind=kind, batch=batch_id, rows=int(got["rows"]), lo=int(got["lo"]), hi=int(got["hi"]),
            expires_ms=int(got["expires"]),
            buckets=tuple(int(b) for b in (got.get("buckets") or "").split(",") if b) if kind == "ids" else (),
            bucket_ms=BUCKET_MS,
        )


def _write_metrics(kind: str) -> list[F.Column]:
    lo, hi, expires = ("_b", "_b", "_expires_ms") if kind == "ids" else ("ws", "we", "we")
    metrics = [F.count(F.lit(1)).alias("rows"), F.min(lo).alias("lo"), F.max(hi).alias("hi"),
               F.max(expires).alias("expires")]
    if kind == "ids":
        # (an observed array comes back as a Java object: the buckets travel as text)
        buckets = F.sort_array(F.collect_set(F.col("_b")))
        metrics.append(F.array_join(F.transform(buckets, lambda b: b.cast("string")), ",").alias("buckets"))
    return metrics
