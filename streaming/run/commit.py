"""The ``foreachBatch`` functions of streams: one micro-batch, committed exactly once per table.

Spark fixes the input files of every planned batch in its offset log and replays an unfinished
batch after a restart. The handler recomputes the same outputs (windowed jobs from the incremental
store as the previous batch left it; keyed jobs from Spark's state store, which Spark restores) and
commits each table with ``Commit(<query id>[:<restore epoch>], <batch id>)``. Only the batch Spark
may be replaying — the one it had planned but not committed when the stream started — looks for
its commits in the tables; every other batch is known to be new. A table without rows gets no
commit. The batch record (statistics, watermark, store manifest) is written last, and the batch is
acknowledged to Spark only after every table, the store and the record are written.

One commit path for both kinds of job: a batch hands over its outputs (main rows, late rows,
quarantined lines per source) with their row counts, and they are written concurrently.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable

from pyspark import StorageLevel
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ..spark.columns import once
from ..declaration import Job, KeyedJob, WindowedJob
from ..windowed.batch import INTERPRETED_BATCH_LINES, SMALL_BATCH_LINES, BatchStats, Compaction, compact, compaction_due, maintain, plan_batch
from ..errors import CheckpointCorruptError
from .faults import FaultFn
from ..spark.hadoopfs import HadoopFS
from ..checkpoint.layout import Layout, query_id
from ..io.sinks import OP, WATERMARK_KEY, Commit, Sink
from ..checkpoint.records import BatchRecord, EngineState, Records, watermark_of
from ..checkpoint.store import Store
from ..io.tables import JobSinks


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
    state_rows: int | None = None  # what the stream remembers after the batch


ProgressFn = Callable[[BatchResult], None]


@dataclass
class StreamReport:
    """What a run of a stream did. ``batches`` counts the micro-batches that read input or ran the
    job's code (a keyed job's timers); ``stats`` sums them; ``totals`` cover the checkpoint's life."""

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


@dataclass
class Output:
    """A batch's rows for one table, with their count (and time range) known before writing."""

    sink: Sink
    frame: DataFrame | None  # (None: no rows)
    rows: int
    deleted: int = 0
    first_ms: int | None = None
    last_ms: int | None = None
    upsert_keys: list[str] | None = None


def _span(frame: DataFrame, column: str, *extra) -> dict:
    base = once(("span", column), lambda: [F.count(F.lit(1)).alias("n"), F.min(F.unix_millis(column)).alias("lo"),
                                           F.max(F.unix_millis(column)).alias("hi")])
    return frame.agg(*base, *extra).first().asDict()


class _Handler:
    def __init__(self, job: Job, checkpoint: str, sinks: JobSinks, progress: ProgressFn | None, report: StreamReport,
                 fault: FaultFn | None = None):
        self.job = job
        self.layout = Layout(checkpoint)
        self.sinks = sinks
        self.progress = progress
        self.report = report
        self._fault = fault or (lambda point, batch_id: None)
        self._started = False
        self._prefix = ""
        self._replay: int | None = None
        self.records: Records | None = None
        self.state: EngineState | None = None

    def _start(self, spark) -> None:
        """Once per run: the query id, the restore epoch, and which batch Spark may be replaying."""
        if self._started:
            return
        fs = HadoopFS(spark)
        try:
            qid = query_id(fs.read_text(self.layout.metadata))
        except ValueError:
            raise CheckpointCorruptError(
                f"{self.layout.metadata} is unreadable; delete the checkpoint folder to start over"
            ) from None
        epoch = fs.read_text(self.layout.epoch).strip() if fs.exists(self.layout.epoch) else ""
        # After a restore, batches re-run from the savepoint must not match commits the restore rolled back.
        self._prefix = f"{qid}:{epoch}" if epoch else qid
        self.state = EngineState(spark, self.layout.root)
        self.records = Records(self.state)
        self._replay = self.state.replay_candidate()
        self._started = True

    def previous(self, batch_id: int) -> BatchRecord | None:
        record = self.records.before(batch_id)
        if record is not None and record.job_fingerprint != self.job.fingerprint():
            raise CheckpointCorruptError(
                f"checkpoint {self.layout.root} was written by a different shape of job {self.job.name} "
                "(keys, window or aggregates changed); start from a new checkpoint or migrate the state"
            )
        return record

    def commit(self, batch_id: int, watermark_out: int) -> Commit:
        return Commit(self._prefix, batch_id, {"lakestream.job": self.job.name, WATERMARK_KEY: str(watermark_out)})

    def write(self, outputs: list[Output], commit: Commit, batch_id: int) -> dict[str, TableWrite]:
        """Commit every output with rows, concurrently (one Spark job and one table commit each)."""
        replay = batch_id == self._replay
        todo = [o for o in outputs if o.rows]

        def one(o: Output) -> None:
            if o.upsert_keys:
                o.sink.upsert(o.frame, o.upsert_keys, commit, may_exist=replay)
            else:
                o.sink.append(o.frame, commit, may_exist=replay, rows=o.rows)
            self._fault(f"committed:{o.sink.table.name}", commit.version)

        if len(todo) > 1:
            with ThreadPoolExecutor(max_workers=len(todo), thread_name_prefix=f"commit-{self.job.name}") as pool:
                for future in [pool.submit(one, o) for o in todo]:
                    future.result()
        elif todo:
            one(todo[0])
        return {o.sink.table.name: TableWrite(o.rows - o.deleted, o.deleted, o.first_ms, o.last_ms) for o in todo}

    def finish(self, batch_id: int, stats: BatchStats, previous: BatchRecord | None, tables: dict[str, TableWrite],
               started: float, **record) -> None:
        self._fault("before-state", batch_id)
        totals = previous.totals.plus(stats) if previous is not None else stats
        done = BatchRecord(batch_id=batch_id, stats=stats, totals=totals, job_fingerprint=self.job.fingerprint(),
                           job_shape=self.job.shape(), **record)
        self.state.save(done)
        if previous is not None:
            self.state.delete_files(previous.removed)  # no replay can need them any more
        self.records.committed(done)
        self._fault("after-state", batch_id)
        report = self.report
        visible = stats.lines or stats.rows_written or stats.rows_deleted or stats.late or isinstance(self.job, KeyedJob)
        if visible:  # a batch that only completes the firing of the previous one is not a batch of its own
            report.batches += 1
            report.stats = report.stats.plus(stats) if report.batches > 1 else stats
        report.totals = totals
        state_rows = sum((record.get("state_rows") or {}).values()) if record.get("state_rows") else None
        report.last = BatchResult(self.job.name, batch_id, stats, time.perf_counter() - started, tables,
                                  int(time.time() * 1000), state_rows)
        report.batch_done.set()
        if self.progress and visible:
            self.progress(report.last)


# Settings a small batch's own plans run with (after the plan Spark made for the batch), put back when
# the batch ends: Spark records the stream's shuffle partitions in its offset log.
_ONE_PARTITION = {"spark.sql.shuffle.partitions": "1"}
_INTERPRETED = {"spark.sql.codegen.wholeStage": "false", "spark.sql.codegen.factoryMode": "NO_CODEGEN"}


def _override(spark, settings: dict[str, str], before: dict[str, str | None]) -> None:
    """Set ``settings`` in the session, remembering in ``before`` what to put back (see :func:`_restore`)."""
    for key, value in settings.items():
        before.setdefault(key, spark.conf.get(key, None))
        spark.conf.set(key, value)


def _restore(spark, before: dict[str, str | None]) -> None:
    for key, value in before.items():
        if value is None:
            spark.conf.unset(key)
        else:
            spark.conf.set(key, value)


class WindowedHandler(_Handler):
    """``foreachBatch`` of a windowed job: the engine's batch over the incremental store, then the commits."""

    job: WindowedJob

    def __init__(self, *args, store_schemas: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.store_schemas = store_schemas

    def __call__(self, raw: DataFrame, batch_id: int) -> None:
        spark = raw.sparkSession
        started = t = time.perf_counter()
        timed = self.report.timed
        # The statistics (a global aggregate) gain nothing from adaptive execution, which would run each of
        # their stages as a job of its own; a large batch turns it on after them (see below).
        spark.conf.set("spark.sql.adaptive.enabled", "false")
        # Observed metrics (counts taken while writing) must survive an empty batch: AQE would replace an
        # empty subtree, and the metrics node with it, by an empty relation.
        spark.conf.set("spark.sql.adaptive.optimizer.excludedRules",
                       "org.apache.spark.sql.execution.adaptive.AQEPropagateEmptyRelation")
        # A collect with a limit (the repeated ids) reads every partition in one job, not one and then the rest.
        spark.conf.set("spark.sql.limit.initialNumPartitions", "1000")
        self._start(spark)
        self._fault("batch-start", batch_id)
        job = self.job
        previous = self.previous(batch_id)
        w_in = watermark_of(previous)
        store = Store(spark, self.layout, previous.store if previous is not None else None, self.store_schemas)
        batch = plan_batch(job, raw, watermark_in_ms=w_in, store=store, batch_id=batch_id,
                           lines_before=previous.stats.lines if previous is not None else None)
        stored = quarantined = None
        compaction = None
        before: dict[str, str | None] = {}
        try:
            due = compaction_due(job, store, w_in)
            if due:  # merging the store's small files reads only what earlier batches wrote: alongside this batch
                compacting = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"compact-{job.name}")
                compaction = compacting.submit(compact, job, store, batch_id, w_in, batch.types(), due)
                compacting.shutdown(wait=False)
            stats = batch.stats()
            w_out = batch.next_watermark()
            if stats.lines <= SMALL_BATCH_LINES:
                # A small batch's time is per-plan overhead: one shuffle partition, no re-planning per stage.
                _override(spark, _ONE_PARTITION, before)
                if stats.lines <= INTERPRETED_BATCH_LINES:
                    _override(spark, _INTERPRETED, before)
            else:
                # foreachBatch runs in the stream's session clone, where Spark turns AQE off for the sake of
                # stateful operators. A windowed job's stream has none, so adaptive execution is safe here.
                spark.conf.set("spark.sql.adaptive.enabled", "true")
            t = timed("parse + stats", t)
            commit = self.commit(batch_id, w_out)
            # Three strands overlap: the quarantine's commit (it reads nothing but the cached lines) starts
            # now; the store's write once the batch's events are planned; the late rows, the fired windows
            # and their commits on this thread. None of them reads what another adds.
            pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"batch-{job.name}")
            quarantined = pool.submit(lambda: self.write(
                [Output(self.sinks.quarantine[s], batch.quarantine(s), n) for s, n in batch.quarantined_by_source.items()],
                commit, batch_id))
            fired = batch.fire(w_out)
            stored = pool.submit(store.write, batch_id, fired.store)
            pool.shutdown(wait=False)
            t = timed("plan", t)
            outputs = []
            n_late = 0
            if batch.may_be_late():  # only a batch with events behind the watermark counts its late rows
                late = batch.cache(batch.late())
                span = _span(late, "window_start")
                n_late = span["n"]
                outputs.append(Output(self.sinks.late, late, n_late, 0, span["lo"], span["hi"]))
            written = deleted = 0
            if fired.rows is not None:
                kept = batch.cache(fired.rows)
                extra = once("deleted", lambda: [F.count(F.when(F.col(OP) == "delete", 1)).alias("deleted")]) \
                    if OP in kept.columns else []
                span = _span(kept, "window_start", *extra)
                deleted = span.get("deleted") or 0
                written = span["n"] - deleted
                outputs.append(Output(self.sinks.main, kept, span["n"], deleted, span["lo"], span["hi"],
                                      [*job.keys, "window_start"] if job.upserts else None))
            t = timed("fire windows", t)
            tables = self.write(outputs, commit, batch_id)
            tables.update(quarantined.result())
            t = timed("commits", t)
            new_files = stored.result()
            events = sum(f.rows for f in new_files if f.kind == "ids")
            t = timed("dedup + windows + store", t)
            stored = None
            manifest, removed = maintain(job, store, new_files, compaction.result() if compaction else Compaction(), w_out)
            stats = replace(stats, events=events, duplicates=stats.events - events, late=n_late,
                            rows_written=written, rows_deleted=deleted, watermark_out_ms=w_out)
            self.finish(batch_id, stats, previous, tables, started, store=manifest, removed=tuple(removed),
                        state_rows=manifest.rows())
            timed("store + record", t)
        finally:
            for strand in (quarantined, stored, compaction):  # a failure elsewhere: let the others end first
                if strand is not None:
                    strand.exception()
            _restore(spark, before)
            batch.release()


class KeyedHandler(_Handler):
    """``foreachBatch`` of a keyed job: the runtime's output rows split by kind and committed."""

    job: KeyedJob

    def __init__(self, *args, main_schema, key_buckets: int, bucket_labels: tuple[int, ...] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.main_schema = main_schema
        self.key_buckets = key_buckets
        self.bucket_labels = bucket_labels
        self._statistics: list | None = None

    def statistics(self) -> list:
        """The batch's counts and time ranges, in the job that runs the state function (built once: each
        column is a few calls into the JVM)."""
        if self._statistics is None:
            job = self.job
            self._statistics = [
                F.count(F.when(F.col("_kind") == "out", 1)).alias("out"),
                F.count(F.when(F.col("_kind") == "late", 1)).alias("late"),
                F.coalesce(F.sum(F.when(F.col("_kind") == "q", F.col("_q_n"))), F.lit(0)).alias("bad"),
                F.coalesce(F.sum("_s_in"), F.lit(0)).alias("inputs"),
                F.coalesce(F.sum("_s_dup"), F.lit(0)).alias("dups"),
                F.max("_s_max_t").alias("max_t"),
                F.max("_s_wm").alias("wm"),
                F.min(F.when(F.col("_kind") == "out", F.unix_millis(F.col(f"_o_{job.time_column}")))).alias("out_lo"),
                F.max(F.when(F.col("_kind") == "out", F.unix_millis(F.col(f"_o_{job.time_column}")))).alias("out_hi"),
                F.min(F.when(F.col("_kind") == "late", F.col("_l_t"))).alias("late_lo"),
                F.max(F.when(F.col("_kind") == "late", F.col("_l_t"))).alias("late_hi"),
                *[F.coalesce(F.sum(F.when((F.col("_kind") == "q") & (F.col("_q_src") == s.name), F.col("_q_n"))), F.lit(0))
                  .alias(f"q_{s.name}")
                  for s in job.sources],
            ]
        return self._statistics

    def __call__(self, frame: DataFrame, batch_id: int) -> None:
        from ..spark.keyed import split

        spark = frame.sparkSession
        started = t = time.perf_counter()
        timed = self.report.timed
        self._start(spark)
        job = self.job
        previous = self.previous(batch_id)
        before: dict[str, str | None] = {}
        frame = frame.persist(StorageLevel.MEMORY_AND_DISK)
        try:
            row = frame.agg(*self.statistics()).first()
            t = timed("state function", t)
            if row["inputs"] + row["bad"] <= SMALL_BATCH_LINES:
                # The state function's plan is fixed (Spark planned it with the checkpoint's partitions); what
                # follows splits a small output by table and shuffles it for each table's layout: one partition.
                _override(spark, _ONE_PARTITION, before)
            watermark_in = watermark_of(previous) if row["wm"] is None else int(row["wm"])
            max_t = row["max_t"]
            watermark_out = watermark_in if max_t is None else max(watermark_in, max_t - job.watermark.out_of_orderness_ms)
            parts = split(job, frame, self.main_schema, watermark_in)

            def part(name: str, rows: int) -> DataFrame | None:  # (a table without rows gets no commit)
                return parts[name] if rows else None

            outputs = [Output(self.sinks.quarantine[s.name], part(f"quarantine:{s.name}", row[f"q_{s.name}"]),
                              row[f"q_{s.name}"]) for s in job.sources]
            outputs.append(Output(self.sinks.late, part("late", row["late"]), row["late"], 0, row["late_lo"],
                                  row["late_hi"]))
            outputs.append(Output(self.sinks.main, part("main", row["out"]), row["out"], 0, row["out_lo"], row["out_hi"]))
            tables = self.write(outputs, self.commit(batch_id, watermark_out), batch_id)
            t = timed("commits", t)
            stats = BatchStats(
                lines=row["inputs"] + row["bad"], quarantined=row["bad"], events=row["inputs"] - row["dups"],
                duplicates=row["dups"], late=row["late"], rows_written=row["out"], max_event_time_ms=max_t,
                watermark_in_ms=watermark_in, watermark_out_ms=watermark_out,
            )
            self.finish(batch_id, stats, previous, tables, started, key_buckets=self.key_buckets,
                        bucket_labels=self.bucket_labels)
            timed("save record", t)
        finally:
            _restore(spark, before)
            frame.unpersist()

