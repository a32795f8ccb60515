"""The ``foreachBatch`` functions of streams: one micro-batch, committed exactly once per table.

Spark fixes the input files of every planned batch in its offset log and replays an unfinished
batch after a restart. The handler recomputes the same outputs (windowed jobs from the incremental
store as the previous batch left it; keyed jobs from the key files that Spark's group state, which
Spark restores, names) and
commits each table with ``Commit(<query id>[:<restore epoch>], <batch id>)``. Only the batch Spark
may be replaying — the one it had planned but not committed when the stream started — looks for
its commits in the tables; every other batch is known to be new. A table without rows gets no
commit. The batch record (statistics, watermark, store manifest) is written last, and the batch is
acknowledged to Spark only after every table, the store and the record are written.

One commit path for both kinds of job: a batch hands over its outputs (main rows, late rows,
quarantined lines per source) with their row counts, and they are written concurrently. The batch of
each kind of job is in ``run/windowed.py`` and ``run/keyed.py``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from pyspark.sql import DataFrame, Observation
from pyspark.sql import functions as F

from ..checkpoint.layout import Layout, commit_app_id
from ..checkpoint.records import BatchRecord, BatchStats, EngineState, Records
from ..declaration import Job, KeyedJob
from ..errors import CheckpointCorruptError
from ..io.sinks import WATERMARK_KEY, Commit, Sink
from ..spark.columns import once
from ..spark.hadoopfs import HadoopFS
from ..spark.metrics import observe, observed_if_any
from .faults import FaultFn
from ..io.tables import JobSinks

log = logging.getLogger(__name__)


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
    outside_batch: bool = False  # side rows kept by earlier batches, committed between batches (``run.side``)


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
    handler: object | None = field(default=None, repr=False)  # the stream's foreachBatch (its side rows: ``run.side``)

    def timed(self, step: str, started: float) -> float:
        now = time.perf_counter()
        self.step_seconds[step] = self.step_seconds.get(step, 0.0) + now - started
        return now


@dataclass
class Output:
    """A batch's rows for one table, with their count (and time range) known before writing; or, with ``rows``
    None, counted while they are written (``span``: the time column whose range they cover; ``expected``: a
    bound on their number, when one is known, for the sink's choice of write)."""

    sink: Sink
    frame: DataFrame | None  # (None: no rows)
    rows: int | None
    deleted: int = 0
    first_ms: int | None = None
    last_ms: int | None = None
    upsert_keys: list[str] | None = None
    span: str | None = None
    expected: int | None = None

    @property
    def counted_while_written(self) -> bool:
        return self.rows is None and self.frame is not None


def count_span_columns(column: str) -> list:
    """Aggregates of a frame's row count and the range of its time ``column`` (epoch ms): ``n``, ``lo``, ``hi``."""
    return once(("span", column), lambda: [F.count(F.lit(1)).alias("n"), F.min(F.unix_millis(column)).alias("lo"),
                                           F.max(F.unix_millis(column)).alias("hi")])


def count_span(frame: DataFrame, column: str, *extra) -> dict:
    return frame.agg(*count_span_columns(column), *extra).first().asDict()


_OBSERVED = itertools.count()


class Handler:
    def __init__(self, job: Job, checkpoint: str, sinks: JobSinks, progress: ProgressFn | None, report: StreamReport,
                 fault: FaultFn | None = None, lease=None):
        self.job = job
        self.layout = Layout(checkpoint)
        self.sinks = sinks
        self.progress = progress
        self.report = report
        self._fault = fault or (lambda point, batch_id: None)
        self.lease = lease  # the job's lease: checked before every commit (a runner that lost it must not commit)
        self._started = False
        self._prefix = ""
        self._replay: int | None = None
        self._replay_known = False
        self.records: Records | None = None
        self.state: EngineState | None = None
        self.expiry: SnapshotExpiry | None = None  # set by the runner: a stream expires its own tables' snapshots
        self.pending_tables = None  # the tables being created or checked meanwhile (``io.tables.TablesPending``), if they are

    def tables_ready(self) -> None:
        """Wait until the job's tables exist (see ``io.tables.TablesPending``): before anything is committed to them."""
        if self.pending_tables is not None:
            self.pending_tables.wait()
            self.pending_tables = None

    def _start(self, spark) -> None:
        """Once per run: the query id, the restore epoch, and which batch Spark may be replaying."""
        if self._started:
            return
        try:  # (after a restore, an epoch: batches re-run from the savepoint must not match rolled-back commits)
            self._prefix = commit_app_id(HadoopFS(spark), self.layout)
        except ValueError:
            raise CheckpointCorruptError(
                f"{self.layout.metadata} is unreadable; delete the checkpoint folder to start over"
            ) from None
        self.state = EngineState(spark, self.layout.root)
        self.records = Records(self.state)
        if not self._replay_known:  # (as a last resort: the batch in flight may then be taken for a replay)
            self._replay = self.state.replay_candidate()
        self._started = True

    def begin(self, spark, batch_id: int) -> None:
        """At a batch's start: the run's setup (:meth:`_start`), then the expiry of old snapshots when due. Here
        every batch before this one is recorded by Spark and by us, and this one has committed nothing yet: each
        commit a replay may look up is newer than the expiry. A batch that may itself be a replay (whose commits
        from before a crash are in the tables) does not expire."""
        self._start(spark)
        if self.expiry is not None and batch_id != self._replay and self.expiry.due():
            self.tables_ready()
            self.expiry.maybe_run()

    def before_start(self, spark, resuming: bool) -> None:
        """Called before the query starts: the one batch Spark may replay is the one an earlier run planned and did
        not commit; every batch this run plans is new. (Found at the first batch instead, this run's own first plan
        is in the offset log already and looks the same: the first batch of every run would look its commits up
        in every table.)"""
        self._replay = EngineState(spark, self.layout.root).replay_candidate() if resuming else None
        self._replay_known = True

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
        """Commit every output with rows, concurrently (one Spark job and one table commit each). An output
        counted while written is committed even when it turns out empty (an empty commit: exactly-once all
        the same), and reported only when it had rows."""
        replay = batch_id == self._replay
        todo = [o for o in outputs if o.rows or o.counted_while_written]
        if todo:
            self.tables_ready()
        if self.lease is not None and todo:
            self.lease.check()
        seen: dict[int, Observation] = {}

        def one(o: Output) -> None:
            frame = o.frame
            if o.counted_while_written:
                seen[id(o)] = Observation(f"written-{self.job.name}-{next(_OBSERVED)}")
                frame = observe(frame, seen[id(o)], count_span_columns(o.span))
            if o.upsert_keys:
                o.sink.upsert(frame, o.upsert_keys, commit, may_exist=replay)
            else:
                o.sink.append(frame, commit, may_exist=replay, rows=o.rows if o.rows is not None else o.expected)
            self._fault(f"committed:{o.sink.table.name}", commit.version)

        if len(todo) > 1:
            with ThreadPoolExecutor(max_workers=len(todo), thread_name_prefix=f"commit-{self.job.name}") as pool:
                for future in [pool.submit(one, o) for o in todo]:
                    future.result()
        elif todo:
            one(todo[0])
        tables = {}
        for o in todo:
            if id(o) in seen:
                got = observed_if_any(seen[id(o)])
                if not got or not got.get("n"):  # (a replay that found its commit wrote nothing: no metrics)
                    continue
                o.rows, o.first_ms, o.last_ms = int(got["n"]), got["lo"], got["hi"]
            tables[o.sink.table.name] = TableWrite(o.rows - o.deleted, o.deleted, o.first_ms, o.last_ms)
        return tables

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


class SnapshotExpiry:
    """A stream's expiry of the snapshots of the tables only its job writes (docs/design-snapshot-expiry.md):
    at a batch's start (see ``Handler.begin``), at most once per ``every_s`` (the first time ``every_s`` after the
    run's start). A shared table (a source's quarantine) and a table another job reads as its source are left alone.
    Housekeeping: a failure is logged, the stream goes on."""

    def __init__(self, sinks: list, retention_ms: int, every_s: float, say: Callable[[str], None] | None = None):
        self.sinks = sinks
        self.retention_ms = retention_ms
        self.every_s = every_s
        self.say = say
        self.last = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self.last >= self.every_s

    def maybe_run(self) -> None:
        if not self.due():
            return
        self.last = time.monotonic()
        for sink in self.sinks:
            try:
                before, after = sink.expire(self.retention_ms)
            except Exception as exc:  # noqa: BLE001 - housekeeping must not stop the stream
                log.warning("could not expire the snapshots of %s (%s); they stay until the next try",
                            sink.table.name, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                continue
            if before > after and self.say:
                self.say(f"{sink.table.name}: expired {before - after:,} snapshot(s) older than the retention, "
                              f"{after:,} kept")


# Settings a small batch's own plans run with (after the plan Spark made for the batch), put back when
# the batch ends: Spark records the stream's shuffle partitions in its offset log.
ONE_PARTITION = {"spark.sql.shuffle.partitions": "1"}
INTERPRETED = {"spark.sql.codegen.wholeStage": "false", "spark.sql.codegen.factoryMode": "NO_CODEGEN"}


def override(spark, settings: dict[str, str], before: dict[str, str | None]) -> None:
    """Set ``settings`` in the session, remembering in ``before`` what to put back (see :func:`restore`)."""
    for key, value in settings.items():
        before.setdefault(key, spark.conf.get(key, None))
        spark.conf.set(key, value)


def restore(spark, before: dict[str, str | None]) -> None:
    for key, value in before.items():
        if value is None:
            spark.conf.unset(key)
        else:
            spark.conf.set(key, value)
