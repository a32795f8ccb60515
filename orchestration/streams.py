"""Streams as long-running Dagster runs: one job per streaming application (``<job>_stream``).

While a stream runs, each committed micro-batch becomes an ``AssetMaterialization`` of every
table and day partition it touched, with numeric metadata Dagster plots (rows in and written,
input and processing rate, batch duration, watermark and its lag, state rows, table version).
A run's event log slows down past a few thousand events, so the events of one table and
partition are merged over ``materialize_every`` (default 10 s; ``0s`` logs every batch) and a
continuous run ends itself after ``rollover_after`` (default 24 h); the ``stream_supervisor``
sensor starts the next one from the checkpoint.

A continuous run records that its stream *should be running* (``DesiredState``). Terminating
the run from the UI stops the query after its current batch and records *stopped*; a run that
crashes leaves *running* behind, and the supervisor restarts it.
"""


import json
import queue
import threading
import time

import dagster as dg
from dagster_pyspark import LazyPySparkResource

from streaming.declaration import Job
from streaming.durations import parse_duration
from streaming.handlers import BatchResult
from streaming.jobs import get_job
from streaming.runner import describe_watermark, run_stream
from streaming.tables import job_sinks

from .resources import LakestreamResource
from .tables import day_keys, table_key

STREAM_TAG = "lakestream/stream"


class StreamConfig(dg.Config):
    """How to run the stream."""

    mode: str = "available_now"  # "available_now": consume what exists, then stop | "continuous"
    trigger_interval: str = "5s"
    from_savepoint: str = ""  # a savepoint id: restore it (checkpoint and tables) before starting
    materialize_every: str = "10s"  # merge a table partition's batches into one event per interval
    rollover_after: str = "24h"  # a continuous run ends itself after this long; the supervisor restarts it


class DesiredState:
    """Whether a stream should be running, kept in the Dagster instance (so in its Postgres on a cluster)."""

    def __init__(self, instance: dg.DagsterInstance, job: str):
        self.storage = instance.daemon_cursor_storage
        self.key = f"lakestream/desired/{job}"

    def get(self) -> dict:
        raw = self.storage.get_cursor_values({self.key}).get(self.key)
        return json.loads(raw) if raw else {"state": "stopped"}

    def set(self, state: str, **info) -> None:
        self.storage.set_cursor_values({self.key: json.dumps({"state": state, "updated_ms": int(time.time() * 1000), **info})})


class MaterializationReporter:
    """Turns batch results (from Spark's batch thread) into merged materializations (main thread)."""

    def __init__(self, context: dg.OpExecutionContext, job: Job, versions, every_s: float):
        self.context = context
        self.job = job
        self.versions = versions  # table name -> callable giving the table's current version
        self.every_s = every_s
        self.inbox: queue.Queue[BatchResult] = queue.Queue()
        self.pending: dict[tuple[str, str | None], dict] = {}
        self.last_flush = 0.0
        self.partitions_def = None

    def on_batch(self, result: BatchResult) -> None:
        self.inbox.put(result)

    def tick(self, query) -> None:
        while True:
            try:
                result = self.inbox.get_nowait()
            except queue.Empty:
                break
            self._merge(result, query)
        if self.pending and time.monotonic() - self.last_flush >= self.every_s:
            self.flush()

    def _merge(self, result: BatchResult, query) -> None:
        s = result.stats
        progress = (query.lastProgress or {}) if query is not None else {}
        state_rows = sum(op.get("numRowsTotal", 0) for op in progress.get("stateOperators", []))
        now_ms = int(time.time() * 1000)
        watermark = s.watermark_out_ms
        for table, write in result.tables.items():
            days = day_keys(write.first_ms, write.last_ms, self.partitions_def) or [None]
            for day in days:
                entry = self.pending.setdefault((table, day), {"batches": [], "rows_written": 0, "rows_in": 0,
                                                               "seconds": 0.0})
                entry["batches"].append(result.batch_id)
                entry["rows_written"] += write.rows  # of the batch, over every partition it touched
                entry["rows_in"] += s.lines
                entry["seconds"] += result.seconds
                entry.update(
                    watermark=watermark, state_rows=state_rows, late=s.late, quarantined=s.quarantined,
                    input_rate=float(progress.get("inputRowsPerSecond") or 0.0),
                    processing_rate=float(progress.get("processedRowsPerSecond") or 0.0),
                    lag_s=max(0.0, (now_ms - watermark) / 1000) if 0 < watermark < 2**61 else 0.0,
                )

    def flush(self) -> None:
        for (table, day), e in self.pending.items():
            version = self.versions[table]()
            metadata = {
                "batches": f"{e['batches'][0]}..{e['batches'][-1]}", "batch_count": len(e["batches"]),
                "rows_in": e["rows_in"], "rows_written": e["rows_written"], "late_events": e["late"],
                "quarantined_lines": e["quarantined"],
                "input_rows_per_s": e["input_rate"], "processed_rows_per_s": e["processing_rate"],
                "batch_seconds": e["seconds"] / len(e["batches"]),
                "watermark": describe_watermark(e["watermark"]),
                "watermark_ms": e["watermark"], "watermark_lag_s": e["lag_s"], "state_rows": e["state_rows"],
                "table_version": str(version) if version is not None else "empty",
            }
            self.context.log_event(dg.AssetMaterialization(asset_key=table_key(table), partition=day, metadata=metadata))
        self.pending.clear()
        self.last_flush = time.monotonic()


def stream_job(job: Job, partitions_def) -> dg.JobDefinition:
    @dg.op(name=job.name, description=f"Run {job.name} as a stream.", tags={"kind": "spark"})
    def run(context: dg.OpExecutionContext, config: StreamConfig, lakestream: LakestreamResource,
            pyspark: LazyPySparkResource) -> None:
        if config.mode not in ("available_now", "continuous"):
            raise dg.Failure(f"mode must be 'available_now' or 'continuous', got {config.mode!r}")
        settings = lakestream.settings().with_job(
            job.name, trigger_interval=parse_duration(config.trigger_interval, field="trigger_interval"))
        declared = get_job(job.name, settings)
        spark = lakestream.spark(pyspark)
        desired = DesiredState(context.instance, job.name)
        if config.from_savepoint:
            from streaming.savepoints import Savepoints

            Savepoints(spark, settings, progress=context.log.info).restore(declared, config.from_savepoint)
        continuous = config.mode == "continuous"
        if continuous:
            desired.set("running", run_id=context.run_id, mode=config.mode, trigger_interval=config.trigger_interval,
                        materialize_every=config.materialize_every, rollover_after=config.rollover_after)
        sinks = job_sinks(spark, settings, declared)
        versions = {s.table.name: s.version for s in sinks.all()}
        reporter = MaterializationReporter(context, declared, versions,
                                           parse_duration(config.materialize_every).total_seconds())
        reporter.partitions_def = partitions_def
        stop = threading.Event()
        rolled = threading.Timer(parse_duration(config.rollover_after).total_seconds(), stop.set)
        if continuous:
            rolled.start()
        try:
            # Dagster terminates a run with SIGINT (SIGTERM on a cluster). Taken as a stop request, it
            # never lands inside a Py4J call or an event-log write: the query stops after its batch.
            report = run_stream(spark, settings, declared, available_now=not continuous, progress=reporter.on_batch,
                                stop_event=stop, install_signal_handlers=True, tick=reporter.tick)
        except BaseException:
            if _terminating(context):  # interrupted before the stop request could be taken
                desired.set("stopped", reason="terminated", run_id=context.run_id)
                reporter.flush()
            raise
        finally:
            rolled.cancel()
        reporter.flush()
        if report.signal is not None:  # terminated from the UI (or the process was asked to stop)
            last = report.last.batch_id if report.last is not None else None
            if _terminating(context):
                desired.set("stopped", reason="terminated", run_id=context.run_id)
            context.log.info(f"{job.name}: {report.signal} received; stopped after batch {last}")
            raise dg.DagsterExecutionInterruptedError(f"{job.name} was interrupted ({report.signal}); "
                                                      f"its checkpoint is at batch {last}")
        if continuous and stop.is_set():
            context.log.info(f"{job.name}: rolled over after {config.rollover_after}; the supervisor starts the next run")
        s = report.stats
        context.log.info(f"{job.name}: {report.batches} batch(es), {s.lines:,} lines, {s.rows_written:,} rows written; "
                         f"watermark {describe_watermark(report.totals.watermark_out_ms if report.totals else None)}")

    @dg.job(name=f"{job.name}_stream", description=f"Stream {job.name} ({job.description})",
            tags={STREAM_TAG: job.name})
    def stream():
        run()

    return stream


def _terminating(context: dg.OpExecutionContext) -> bool:
    """Whether this run is being terminated on request (rather than, say, its pod being evicted, after
    which the supervisor restarts it): Dagster marks the run CANCELING before it interrupts it."""
    run = context.instance.get_run_by_id(context.run_id)
    return run is not None and run.status in (dg.DagsterRunStatus.CANCELING, dg.DagsterRunStatus.CANCELED)

