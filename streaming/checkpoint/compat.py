"""The compatibility guard: refuse to resume state written by a different shape of a job.

Flink's rule — never change ``keyBy`` (or a window, or an aggregate) under existing state without a
migration — checked *before* a stream starts, from the checkpoint's newest batch record and its
offset log (which holds the shuffle partitions the state was partitioned with).
"""

from __future__ import annotations

from ..declaration import Job, KeyedJob
from ..errors import IncompatibleStateError
from ..spark.hadoopfs import HadoopFS
from .layout import Layout, numbered, offset_metadata, shuffle_partitions

_LABELS = {
    "kind": "job kind",
    "keys": "key columns",
    "window": "window",
    "aggregates": "aggregates",
    "function": "keyed function",
    "state": "state schema",
    "timers": "timer domain",
    "source": "source",
    "dedup_key": "dedup key",
}


def differences(stored_shape: dict | None, stored_partitions: int | None, job: Job,
                shuffle_partitions: int | None) -> list[str]:
    """What changed between the state's job and ``job``, one phrase per change (empty: compatible)."""
    changes = []
    current = job.shape()
    for key, label in _LABELS.items():
        if stored_shape is not None and key in stored_shape and stored_shape[key] != current.get(key):
            changes.append(f"{label} changed from {stored_shape[key]} to {current[key]}")
    if stored_partitions is not None and shuffle_partitions is not None and stored_partitions != shuffle_partitions:
        changes.append(f"shuffle partitions changed from {stored_partitions} to {shuffle_partitions}")
    return changes


def refuse(job: Job, where: str, changes: list[str], checkpoint: str) -> IncompatibleStateError:
    return IncompatibleStateError(
        f"cannot resume {job.name} from {where}: {'; '.join(changes)}. Its state was built for the old shape "
        f"(as in Flink, key/window/aggregate changes need a state migration): revert the change, or start "
        f"over from an empty checkpoint (move {checkpoint} away) and backfill the tables"
    )


def stream_partitions(spark, job: Job, stored: int | None) -> int:
    """The shuffle partitions a stream of ``job`` runs with (``stored``: its checkpoint's, if any).

    A keyed stream on a local master starts with no more partitions than the machine's cores: each
    partition is one task of the state function per batch, with its own fixed cost (a Python round trip,
    a state store commit), and partitions beyond the cores only queue behind each other (on 2 cores, 4
    partitions ran in two waves: ~0.1 s more per batch than 2). The count then stays the stream's: Spark
    restores it from the offset log, so a keyed stream on a local master keeps what it started with. On
    a cluster (executors may still be joining) and for windowed jobs it is the configured count."""
    configured = int(spark.conf.get("spark.sql.shuffle.partitions"))
    if not isinstance(job, KeyedJob) or not spark.sparkContext.master.startswith("local"):
        return configured
    if stored is not None:
        return stored
    return max(1, min(configured, spark.sparkContext.defaultParallelism))


def stored_shuffle_partitions(fs: HadoopFS, checkpoint: str) -> int | None:
    """``spark.sql.shuffle.partitions`` recorded in the checkpoint's newest offset-log entry."""
    layout = Layout(checkpoint)
    batches = numbered(fs.list_names(layout.offsets))
    if not batches:
        return None
    try:
        return shuffle_partitions(offset_metadata(fs.read_text(layout.offset(batches[-1])), layout.offset(batches[-1])))
    except ValueError:
        return None


def check_resume(spark, job: Job, checkpoint: str, shuffle_partitions: int | None,
                 where: str | None = None) -> None:
    """Raise :class:`IncompatibleStateError` if ``checkpoint`` holds state of another shape of ``job``."""
    from .records import EngineState

    record = EngineState(spark, checkpoint).latest_record()
    fs = HadoopFS(spark)
    partitions = stored_shuffle_partitions(fs, checkpoint)
    shape = record.job_shape if record else None
    changes = differences(shape, partitions, job, shuffle_partitions)
    if record is not None and not changes and shape is None and record.job_fingerprint != job.fingerprint():
        changes = ["keys, window or aggregates changed (the checkpoint predates shape records)"]
    if changes:
        raise refuse(job, where or f"checkpoint {checkpoint}", changes, checkpoint)
