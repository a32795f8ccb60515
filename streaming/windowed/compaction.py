"""The incremental store's upkeep after a windowed stream's batch: small files merged into one per kind
(alongside the batch: it reads only what earlier batches wrote), and files whose rows have all expired
dropped, so the store holds what open windows and remembered ids need and no more."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from ..checkpoint.store import BUCKET_MS, COMPACT_EVERY, Manifest, Store, StoreFile
from ..declaration import WindowedJob
from ..io.schemas import piece_name
from ..spark.columns import as_param, param, same_keys
from ..windows import WE, WS
from ..windows.fixed import FixedWindows
from ..windows.session import newest_evals
from .aggregates import Aggregates


def _expired(job: WindowedJob, f: StoreFile, watermark_ms: int) -> bool:
    """Whether every row of a store file has expired at ``watermark_ms`` (ids: every id forgotten;
    pieces of tumbling/sliding windows: every window closed beyond lateness)."""
    if f.kind == "ids":
        return f.expires_ms <= watermark_ms
    return job.window.pieces_expire() and f.expires_ms + job.watermark.allowed_lateness_ms <= watermark_ms


@dataclass
class Compaction:
    """Files that replace others in the store (see :func:`compact`)."""

    made: list[StoreFile] = field(default_factory=list)
    replaced: list[StoreFile] = field(default_factory=list)


def compaction_due(job: WindowedJob, store: Store, watermark_ms: int) -> dict[str, list[StoreFile]]:
    """The files to merge, by kind: once a kind has ``COMPACT_EVERY`` live files (ids: of single batches;
    pieces and session evaluations together)."""
    keep = [f for f in store.manifest.files if not _expired(job, f, watermark_ms)]
    due: dict[str, list[StoreFile]] = {}
    ids = [f for f in keep if f.kind == "ids" and not f.path.rsplit("/", 2)[-2].startswith("c")  # per-batch files
           and f.bucket_ms == BUCKET_MS]  # (files with wider buckets are left to expire)
    if len(ids) >= COMPACT_EVERY:
        due["ids"] = ids
    pieces = [f for f in keep if f.kind == "pieces"]
    evals = [f for f in keep if f.kind == "evals"]
    if pieces and (len(pieces) >= COMPACT_EVERY or len(evals) >= COMPACT_EVERY):
        due["pieces"] = pieces
        if evals:
            due["evals"] = evals
    return due


# Files of a kind with at most this many rows in all are merged by the driver (pyarrow), with no Spark job beside the
# batch: under the latency feed, a batch that ran beside a merge by Spark took ~0.15 s more than one that did not.
DRIVER_MERGE_ROWS = 1_000_000
# Pieces the driver combines: those whose piece is the value and combines by a sum, a least or a greatest value.
_DRIVER_COMBINE = {"count": "sum", "sum": "sum", "min": "min", "max": "max"}


def _merged_by_driver(job: WindowedJob) -> bool:
    """Whether the driver can merge the job's pieces (:func:`_open_pieces`): tumbling or sliding windows (one row per
    key and window) of aggregates in :data:`_DRIVER_COMBINE` (the others combine sketches, by Spark's expressions)."""
    return isinstance(job.window, FixedWindows) and all(a.kind in _DRIVER_COMBINE for a in job.aggregates)


def _open_pieces(job: WindowedJob, pieces: pa.Table | None, watermark_ms: int) -> pa.Table | None:
    """The pieces of each key and window combined into one (as ``Aggregates.merge`` combines them: a sum, a least or a
    greatest value, NULLs left out, NULL keys a group of their own), of the windows still open at ``watermark_ms``."""
    if pieces is None:
        return None
    groups = [*job.keys, WS, WE]
    open_ = pieces.filter(pc.greater(pc.add(pieces[WE], job.watermark.allowed_lateness_ms), watermark_ms))
    combined = open_.group_by(groups, use_threads=False).aggregate(
        [(piece_name(a), _DRIVER_COMBINE[a.kind]) for a in job.aggregates])
    columns = [*groups, *[piece_name(a) for a in job.aggregates]]
    combined = combined.select([*groups, *[f"{piece_name(a)}_{_DRIVER_COMBINE[a.kind]}" for a in job.aggregates]])
    return combined.rename_columns(columns).cast(pa.schema([pieces.schema.field(n) for n in columns]))


def compact(job: WindowedJob, store: Store, batch_id: int, watermark_ms: int, types: dict[str, T.DataType],
            due: dict[str, list[StoreFile]]) -> Compaction:
    """Merge the files ``due`` (see :func:`compaction_due`) into one per kind (sessions: re-merged, closed
    ones dropped; rows expired at ``watermark_ms`` — the batch's incoming watermark — left out). It reads
    nothing the batch writes, so it runs alongside the batch, off its critical path; the batch's
    manifest swaps the files at the end."""
    lateness = job.watermark.allowed_lateness_ms
    merged: dict[str, DataFrame | pa.Table] = {}
    if "ids" in due:
        if sum(f.rows for f in due["ids"]) <= DRIVER_MERGE_ROWS:
            ids = store.read_table("ids", due["ids"])
            merged["ids"] = None if ids is None else ids.filter(pc.greater(ids["_expires_ms"], watermark_ms))
        else:
            merged["ids"] = store.read("ids", due["ids"]).where(as_param(F.col("_expires_ms")) > param(watermark_ms))
    if "pieces" in due and "evals" not in due and _merged_by_driver(job) \
            and sum(f.rows for f in due["pieces"]) <= DRIVER_MERGE_ROWS:
        merged["pieces"] = _open_pieces(job, store.read_table("pieces", due["pieces"]), watermark_ms)
    elif "pieces" in due:
        open_windows = Aggregates(job, types).merge(store.read("pieces", due["pieces"]))
        open_windows = open_windows.where(as_param(F.col(WE) + F.lit(lateness)) > param(watermark_ms))
        merged["pieces"] = open_windows
        if "evals" in due:
            recent = newest_evals(store.read("evals", due["evals"]), job.keys)
            spans = open_windows.select(*[F.col(k).alias(f"_s_{k}") for k in job.keys], F.col(WS).alias("_s_ws"),
                                        F.col(WE).alias("_s_we"))
            inside = same_keys(job.keys, "_s_") & (F.col(WS) >= F.col("_s_ws")) & (F.col(WS) < F.col("_s_we"))
            merged["evals"] = recent.join(spans, inside, "left_semi")
    made = store.write(batch_id, merged, folder=f"{store.layout.store}/c{batch_id}")
    return Compaction(made, [f for files in due.values() for f in files])


def maintain(job: WindowedJob, store: Store, new_files: list[StoreFile], compaction: Compaction,
             watermark_out_ms: int) -> tuple[Manifest, list[str]]:
    """The store after a batch: its new files and the compaction's in place of the files they replace,
    files whose rows have all expired at ``W_out`` dropped. Returns the new manifest and the folders to
    delete once no replay can need them."""
    files = [*store.manifest.files, *new_files, *compaction.made]
    gone = {f.path for f in compaction.replaced}
    keep = [f for f in files if f.path not in gone and not _expired(job, f, watermark_out_ms)]
    live = {f.path for f in keep}
    removed = [f.path for f in files if f.path not in live]
    bases = {f.path.rsplit("/", 1)[0] for f in keep}
    removed += sorted({p.rsplit("/", 1)[0] for p in removed} - bases)
    return Manifest(keep), removed
