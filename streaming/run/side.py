"""Side outputs on an interval: a windowed stream commits its late rows and quarantined lines every
``side_outputs_every`` (when set: the default 0 commits them with every batch), as Flink's Iceberg sink commits on
checkpoints (docs/design-side-outputs.md).

* A batch that does not commit them writes its side rows into its checkpoint (``side/<batch>/<table>``, Parquet,
  written by the executors) and its record lists them as ``pending``, with those of earlier batches.
* A batch commits them (appends the pending rows and its own, with its own ``Commit``) once the oldest is
  ``side_outputs_every`` old, when they pass ``PENDING_MAX_ROWS``, or when it may be a replay (its first attempt
  may have committed them: it looks its commit up, as every replay does). Its record drops them; their files go
  when the next batch is recorded, as the store's do.
* Outside any batch (:func:`commit_pending`): when a stream stops (its last batch's rows), when it idles with
  rows due, when a stream starts and its checkpoint holds pending rows (a crash), and before a savepoint copies
  the checkpoint or a backfill reads the side tables. Such a commit carries ``Commit(<app id>~flush, <batch>)``
  for the record whose rows it commits, looked up per table first (a commit that died after some tables is
  finished, not repeated); then the record is rewritten without the rows. When Spark will replay a batch (planned,
  not committed), the record is the one before it, which the replay starts from; a table that holds the replayed
  batch's commit got that record's rows with it (its first attempt committed its side outputs) and gets nothing.

Quarantined lines carry the commit that writes them (``written_by``, ``batch_id``): pending ones are written
without, and stamped when committed (outside a batch: with the last recorded batch).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from typing import Callable

from pyspark.sql import DataFrame, Observation
from pyspark.sql import functions as F

from ..checkpoint.layout import Layout
from ..checkpoint.records import BatchRecord, EngineState, Pending
from ..io.sinks import Commit, Sink
from ..io.sinks.base import FLUSH
from ..io.tables import JobSinks
from ..spark.hadoopfs import HadoopFS
from ..spark.metrics import observe, observed

# A batch commits the pending side rows once there are this many (they are read back by one job; a backlog of
# late events must not grow the checkpoint without bound).
PENDING_MAX_ROWS = 1_000_000
_WRITES = itertools.count()


def side_sinks(sinks: JobSinks) -> dict[str, Sink]:
    """The side tables of a job by name: its late table and its sources' quarantines."""
    return {s.table.name: s for s in (sinks.late, *sinks.quarantine.values())}


def is_quarantine(sinks: JobSinks, table: str) -> bool:
    return any(s.table.name == table for s in sinks.quarantine.values())


def write_pending(spark, layout: Layout, batch_id: int, table: str, frame: DataFrame, small: bool) -> Pending | None:
    """Write ``frame`` (side rows of ``table``) into the checkpoint for batch ``batch_id`` (a replay overwrites
    them); None when it had no rows."""
    path = layout.side(batch_id, table)
    seen = Observation(f"side-{batch_id}-{next(_WRITES)}")
    out = observe(frame, seen, [F.count(F.lit(1)).alias("n")])
    (out.coalesce(1) if small else out).write.mode("overwrite").parquet(path)
    rows = int(observed(seen).get("n") or 0)
    if not rows:
        HadoopFS(spark).delete(path)
        return None
    return Pending(table=table, path=path, rows=rows, batch=batch_id, written_ms=int(time.time() * 1000))


def read_pending(spark, files: list[Pending], written_by: str | None = None, batch_id: int | None = None
                 ) -> DataFrame:
    """The rows of pending ``files`` (of one table); quarantined lines stamped with the commit that writes them."""
    frame = spark.read.parquet(*[p.path for p in files])
    if written_by is not None:
        frame = frame.withColumn("written_by", F.lit(written_by).cast("string")) \
                     .withColumn("batch_id", F.lit(batch_id).cast("long"))
    return frame


def of_table(pending, table: str) -> list[Pending]:
    return [p for p in pending if p.table == table]


def folders(pending) -> list[str]:
    """The batches' side folders that hold ``pending`` (each batch commits or keeps all of its side rows)."""
    return sorted({p.path.rsplit("/", 1)[0] for p in pending})


def due(pending, every_ms: int, now_ms: int | None = None) -> bool:
    """Whether pending side rows must be committed now: the oldest is ``every_ms`` old, or they are too many."""
    if not pending:
        return False
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    return now_ms - min(p.written_ms for p in pending) >= every_ms or sum(p.rows for p in pending) > PENDING_MAX_ROWS


def commit_pending(spark, state: EngineState, record: BatchRecord, sinks: JobSinks, app_id: str, job_name: str,
                   *, candidate: int | None, fault: Callable[[str, int], None] | None = None,
                   say: Callable[[str], None] | None = None) -> tuple[BatchRecord, dict]:
    """Commit the side rows ``record`` holds, outside any batch (no batch may run meanwhile), then rewrite the record
    without them and delete their files; returns the record as rewritten and what each table got (``TableWrite``).
    ``candidate``: the batch Spark will replay, if any (see the module)."""
    from .commit import TableWrite, count_span_columns

    written: dict[str, TableWrite] = {}
    if not record.pending:
        return record, written
    fault = fault or (lambda point, batch_id: None)
    tables = side_sinks(sinks)
    commit = Commit(app_id + FLUSH, record.batch_id, {"lakestream.job": job_name})
    replayed = Commit(app_id, candidate) if candidate is not None else None
    for table in sorted({p.table for p in record.pending}):
        files = of_table(record.pending, table)
        sink = tables.get(table)
        if sink is None:  # (the job no longer writes that table: its rows cannot go anywhere else)
            raise ValueError(f"{record.batch_id}: side rows pending for {table}, which the job no longer writes")
        if sink.is_committed(commit) or (replayed is not None and sink.is_committed(replayed)):
            continue
        quarantine = is_quarantine(sinks, table)
        stamp = (commit.id, record.batch_id) if quarantine else (None, None)
        rows = sum(p.rows for p in files)
        frame = read_pending(spark, files, *stamp)
        seen = None
        if not quarantine:  # (the late rows' days, for the tables' partitions in Dagster)
            seen = Observation(f"side-span-{next(_WRITES)}")
            frame = observe(frame, seen, count_span_columns("window_start"))
        sink.append(frame, commit, may_exist=False, rows=rows)
        span = observed(seen) if seen is not None else {}
        written[table] = TableWrite(rows, 0, span.get("lo"), span.get("hi"))
        if say:
            say(f"{table}: committed {rows:,} side row(s) kept since batch {min(p.batch for p in files)}")
        fault(f"flushed:{table}", record.batch_id)
    fault("before-flush-record", record.batch_id)
    settled = replace(record, pending=())
    state.save(settled)
    state.delete_files(folders(record.pending))
    return settled, written


def settle_stopped(spark, settings, job, say: Callable[[str], None] | None = None) -> int:
    """Commit the side rows a stopped stream's checkpoint keeps (a crash left them), for whoever holds the job's
    lease without running its stream (a savepoint before its copy, a backfill); returns how many rows."""
    from ..checkpoint.layout import commit_app_id
    from ..declaration import WindowedJob
    from ..io.tables import job_sinks

    if not isinstance(job, WindowedJob):
        return 0
    checkpoint = settings.checkpoint_dir(job.name)
    fs = HadoopFS(spark)
    if not fs.exists(Layout(checkpoint).metadata):
        return 0
    state = EngineState(spark, checkpoint)
    candidate = state.replay_candidate()
    record = state.latest_record_before(candidate) if candidate is not None else state.latest_record()
    if record is None or not record.pending:
        return 0
    commit_pending(spark, state, record, job_sinks(spark, settings, job), commit_app_id(fs, Layout(checkpoint)),
                   job.name, candidate=candidate, say=say)
    return sum(p.rows for p in record.pending)


def side_rows_committed(spark, settings, job, say: Callable[[str], None] | None = None, lease=None) -> None:
    """Before a reader relies on a job's side tables (a backfill absorbing late rows, a reconciliation explaining
    differences): the side rows its stream has kept so far are committed. A stopped stream's are committed here
    (holding the job's lease: ``lease`` when the caller holds it already); a running stream's are waited for (it
    commits them within ``side_outputs_every``, idle or not). A stream that does not is named in a warning."""
    from ..checkpoint.lease import Lease
    from ..declaration import WindowedJob
    from ..errors import LeaseHeldError

    if not isinstance(job, WindowedJob):
        return
    checkpoint = settings.checkpoint_dir(job.name)
    if not HadoopFS(spark).exists(Layout(checkpoint).metadata):
        return
    state = EngineState(spark, checkpoint)
    record = state.latest_record()
    if record is None or not record.pending:
        return
    own = lease is None
    if own:
        lease = Lease(checkpoint, settings.storage_options, job=job.name)
        if lease.holder() is None:
            try:
                lease.acquire("side rows")
            except LeaseHeldError:  # (a stream took it meanwhile: it commits them as it starts)
                lease = None
        else:
            lease = None
    if lease is not None:
        try:
            settle_stopped(spark, settings, job, say=say)
        finally:
            if own:
                lease.release()
        return
    through = record.batch_id
    every = settings.side_outputs_every_of(job.name).total_seconds()
    deadline = time.monotonic() + every + 30
    if say:
        say(f"{job.name}: waiting for its stream to commit the side rows it keeps (it does every {every:g}s)")
    while time.monotonic() < deadline:
        time.sleep(0.5)
        record = state.latest_record()
        if record is None or not any(p.batch <= through for p in record.pending):
            return
    message = (f"{job.name}: its stream has not committed the side rows it kept through batch {through} within "
               f"{every + 30:g}s; late rows it commits after this may count events the result counts too")
    if say:
        say("WARNING: " + message)
    else:
        import logging

        logging.getLogger(__name__).warning(message)
