"""The ``foreachBatch`` functions of streams: one micro-batch, committed exactly once per table.

Spark fixes the input files of every planned batch in its offset log and replays an unfinished
batch after a restart. The handler recomputes the same outputs (windowed: from the engine state
of the previous batch; keyed: Spark restores the state store of the previous batch), and commits
each table with ``Commit(<query id>[:<restore epoch>], <batch id>)``; a table that already holds
that commit is skipped. The batch record (watermark, statistics, job shape) is written last, and
the batch is acknowledged to Spark only after every table and the record are written.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from pyspark import StorageLevel
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from .declaration import Job, KeyedJob, WindowedJob
from .engine import NEG_INF_MS, BatchStats, plan_batch
from .errors import CheckpointCorruptError
from .faults import FaultFn
from .hadoopfs import HadoopFS
from .sinks import OP, WATERMARK_KEY, Commit, Sink
from .state import EngineState
from .tables import JobSinks


@dataclass(frozen=True)
class TableWrite:
    rows: int
    deleted: int = 0
    first_ms: int | None = None  # time range of the rows (partitions touched)
    last_ms: int | None = None


@dataclass(frozen=True)
class BatchResult:
    """One committed micro-batch, for progress output and Dagster materializations."""

    job: str
    batch_id: int
    stats: BatchStats
    seconds: float
    tables: dict[str, TableWrite]
    committed_at_ms: int


ProgressFn = Callable[[BatchResult], None]


@dataclass
class StreamReport:
    job: str
    batches: int = 0
    stats: BatchStats = field(default_factory=BatchStats)
    totals: BatchStats | None = None  # cumulative over the checkpoint's life
    query_id: str | None = None
    last: BatchResult | None = None
    step_seconds: dict[str, float] = field(default_factory=dict)  # where the batches' time went
    batch_done: threading.Event = field(default_factory=threading.Event)  # set when a batch is committed
    signal: str | None = None  # the signal (SIGINT/SIGTERM) that stopped the stream, if one did

    def timed(self, step: str, started: float) -> float:
        now = time.perf_counter()
        self.step_seconds[step] = self.step_seconds.get(step, 0.0) + now - started
        return now


class _Handler:
    def __init__(self, job: Job, checkpoint: str, sinks: JobSinks, progress: ProgressFn | None, report: StreamReport,
                 fault: FaultFn | None = None):
        self.job = job
        self.checkpoint = checkpoint
        self.sinks = sinks
        self.progress = progress
        self.report = report
        self._fault = fault or (lambda point, batch_id: None)
        self._query_id: str | None = None
        self._prefix: str | None = None

    def commit_prefix(self, spark) -> str:
        """``<query id>``, or ``<query id>:<restore epoch>`` after a savepoint restore, so batches
        re-run after a restore never match commits that the restore rolled back."""
        if self._prefix is None:
            fs = HadoopFS(spark)
            epoch_path = f"{self.checkpoint}/lakestream/epoch"
            epoch = fs.read_text(epoch_path).strip() if fs.exists(epoch_path) else ""
            self._prefix = f"{self.query_id(spark)}:{epoch}" if epoch else self.query_id(spark)
        return self._prefix

    def query_id(self, spark) -> str:
        if self._query_id is None:
            text = HadoopFS(spark).read_text(f"{self.checkpoint}/metadata")
            try:
                self._query_id = json.loads(text.splitlines()[0])["id"]
            except (ValueError, KeyError, IndexError):
                raise CheckpointCorruptError(
                    f"{self.checkpoint}/metadata is unreadable; delete the checkpoint folder to start over"
                ) from None
        return self._query_id

    def _commit(self, spark, batch_id: int, watermark_out: int) -> Commit:
        return Commit(self.commit_prefix(spark), batch_id,
                      {"lakestream.job": self.job.name, WATERMARK_KEY: str(watermark_out)})

    def _write(self, sink: Sink, frame: DataFrame, commit: Commit, replay: bool, *, upsert_keys=None) -> None:
        if upsert_keys:
            sink.upsert(frame, upsert_keys, commit, may_exist=replay)
        else:
            sink.append(frame, commit, may_exist=replay)
        self._fault(f"committed:{sink.table.name}", commit.version)

    def _finish(self, state: EngineState, batch_id: int, stats: BatchStats, previous, tables: dict[str, TableWrite],
                started: float, open_windows=None, seen_keys=None, state_bytes: int | None = None) -> None:
        self._fault("before-state", batch_id)
        totals = previous.totals.plus(stats) if previous is not None else stats
        state.save(batch_id, stats, totals, open_windows, seen_keys, self.job.fingerprint(), self.job.shape(),
                   state_bytes)
        self._fault("after-state", batch_id)
        report = self.report
        report.batches += 1
        report.stats = report.stats.plus(stats) if report.batches > 1 else stats
        report.totals = totals
        report.last = BatchResult(self.job.name, batch_id, stats, time.perf_counter() - started, tables,
                                  int(time.time() * 1000))
        report.batch_done.set()
        if self.progress:
            self.progress(report.last)


def _range(frame: DataFrame, column: str, extra=()) -> dict:
    row = frame.agg(F.count(F.lit(1)).alias("n"), F.min(F.unix_millis(column)).alias("lo"),
                    F.max(F.unix_millis(column)).alias("hi"), *extra).first()
    return row.asDict()


class WindowedHandler(_Handler):
    """``foreachBatch`` of a windowed job: the engine's plan, then the commits, then its state."""

    job: WindowedJob

    def __call__(self, raw: DataFrame, batch_id: int) -> None:
        spark = raw.sparkSession
        started = t = time.perf_counter()
        timed = self.report.timed
        # foreachBatch runs in the stream's session clone, where Spark turns AQE off for the sake of
        # stateful operators. Our batch plans keep no Spark state, so adaptive execution is safe here.
        spark.conf.set("spark.sql.adaptive.enabled", "true")
        job = self.job
        state = EngineState(spark, self.checkpoint)
        loaded = state.load_before(batch_id)
        if loaded.record is not None and loaded.record.job_fingerprint != job.fingerprint():
            raise CheckpointCorruptError(
                f"checkpoint {self.checkpoint} was written by a different shape of job {job.name} "
                "(keys, window or aggregates changed); start from a new checkpoint or migrate the state"
            )
        watermark_in = loaded.record.watermark_ms if loaded.record else NEG_INF_MS
        plan = plan_batch(job, raw, watermark_in_ms=watermark_in, open_windows=loaded.open_windows,
                          seen_keys=loaded.seen_keys)
        t = timed("load state", t)
        try:
            stats = plan.stats()
            t = timed("parse + stats", t)
            watermark_out = plan.next_watermark()
            out = plan.finish(watermark_out)
            written = out.written.persist(StorageLevel.MEMORY_AND_DISK)
            deletes = [F.count(F.when(F.col(OP) == "delete", 1)).alias("deleted")] if OP in written.columns else []
            span = _range(written, "window_start", deletes)
            t = timed("aggregate windows", t)
            commit = self._commit(spark, batch_id, watermark_out)
            replay = state.has_intent(batch_id)
            if stats.quarantined or stats.late or span["n"]:
                state.mark_intent(batch_id)
            tables: dict[str, TableWrite] = {}
            for source, count in plan.quarantined_by_source.items():
                if count:  # a stream reads each file once: an idempotent append suffices
                    sink = self.sinks.quarantine[source]
                    self._write(sink, plan.quarantine(source), commit, replay)
                    tables[sink.table.name] = TableWrite(count)
            if stats.late:
                self._write(self.sinks.late, plan.late(), commit, replay)
                late = _range(plan.late(), "window_start")
                tables[self.sinks.late.table.name] = TableWrite(stats.late, 0, late["lo"], late["hi"])
            t = timed("commit quarantine + late", t)
            deleted = span.get("deleted", 0) or 0
            if span["n"]:
                keys = [*job.keys, "window_start"] if job.upserts else None
                self._write(self.sinks.main, written, commit, replay, upsert_keys=keys)
                tables[self.sinks.main.table.name] = TableWrite(span["n"] - deleted, deleted, span["lo"], span["hi"])
            t = timed("commit windows", t)
            stats = BatchStats(**{**stats.__dict__, "rows_written": span["n"] - deleted, "rows_deleted": deleted,
                                  "watermark_out_ms": watermark_out})
            self._finish(state, batch_id, stats, loaded.record, tables, started, out.open_windows, out.seen_keys)
            timed("save state", t)
            written.unpersist()
        finally:
            plan.release()


class KeyedHandler(_Handler):
    """``foreachBatch`` of a keyed job: the runtime's output rows split by kind and committed."""

    job: KeyedJob

    def __init__(self, *args, main_schema, **kwargs):
        super().__init__(*args, **kwargs)
        self.main_schema = main_schema

    def batch_watermark(self, spark, batch_id: int) -> int:
        """The watermark Spark used for ``batch_id`` (its offset-log entry; 0 before any event)."""
        text = HadoopFS(spark).read_text(f"{self.checkpoint}/offsets/{batch_id}")
        try:
            return int(json.loads(text.splitlines()[1]).get("batchWatermarkMs", 0))
        except (ValueError, IndexError):
            raise CheckpointCorruptError(f"{self.checkpoint}/offsets/{batch_id} is unreadable") from None

    def __call__(self, frame: DataFrame, batch_id: int) -> None:
        from .keyed.spark import split

        spark = frame.sparkSession
        started = t = time.perf_counter()
        timed = self.report.timed
        job = self.job
        state = EngineState(spark, self.checkpoint)
        previous = state.latest_record_before(batch_id)
        watermark_in = self.batch_watermark(spark, batch_id)
        frame = frame.persist(StorageLevel.MEMORY_AND_DISK)
        try:
            row = frame.agg(
                F.count(F.when(F.col("_kind") == "out", 1)).alias("out"),
                F.count(F.when(F.col("_kind") == "late", 1)).alias("late"),
                F.count(F.when(F.col("_kind") == "q", 1)).alias("bad"),
                F.coalesce(F.sum("_s_in"), F.lit(0)).alias("inputs"),
                F.coalesce(F.sum("_s_dup"), F.lit(0)).alias("dups"),
                F.max("_s_max_t").alias("max_t"),
                *[F.count(F.when((F.col("_kind") == "q") & (F.col("_q_src") == s.name), 1)).alias(f"q_{s.name}")
                  for s in job.sources],
            ).first()
            t = timed("state function", t)
            max_t = row["max_t"]
            watermark_out = watermark_in if max_t is None else max(watermark_in, max_t - job.watermark.out_of_orderness_ms)
            parts = split(job, frame, self.main_schema, watermark_in)
            commit = self._commit(spark, batch_id, watermark_out)
            replay = state.has_intent(batch_id)
            if row["out"] or row["late"] or row["bad"]:
                state.mark_intent(batch_id)
            tables: dict[str, TableWrite] = {}
            for source in job.sources:
                if row[f"q_{source.name}"]:
                    sink = self.sinks.quarantine[source.name]
                    self._write(sink, parts[f"quarantine:{source.name}"], commit, replay)
                    tables[sink.table.name] = TableWrite(row[f"q_{source.name}"])
            if row["late"]:
                self._write(self.sinks.late, parts["late"], commit, replay)
                late = _range(parts["late"], job.source.event_time)
                tables[self.sinks.late.table.name] = TableWrite(row["late"], 0, late["lo"], late["hi"])
            if row["out"]:
                span = _range(parts["main"], job.time_column)
                self._write(self.sinks.main, parts["main"], commit, replay)
                tables[self.sinks.main.table.name] = TableWrite(row["out"], 0, span["lo"], span["hi"])
            t = timed("commits", t)
            stats = BatchStats(
                lines=row["inputs"] + row["bad"], quarantined=row["bad"], events=row["inputs"] - row["dups"],
                duplicates=row["dups"], late=row["late"], rows_written=row["out"], max_event_time_ms=max_t,
                watermark_in_ms=watermark_in, watermark_out_ms=watermark_out,
            )
            state_bytes = HadoopFS(spark).size(f"{self.checkpoint}/state")
            self._finish(state, batch_id, stats, previous, tables, started, state_bytes=state_bytes)
            timed("save record", t)
        finally:
            frame.unpersist()

