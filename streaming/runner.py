"""Run a job as a stream: Spark's file source + ``foreachBatch`` driving the event-time engine.

Exactly-once: Spark fixes the input files of every planned batch in its offset log and replays an
unfinished batch after a restart; the engine recomputes the same outputs from the state of the
previous batch; each table commit carries ``<query id>:<batch id>`` and is skipped if already
present. The batch is acknowledged to Spark only after every table and the engine state are written.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from . import sinks
from .durations import format_duration, from_epoch_ms, iso_ms
from .declaration import WindowedJob
from .engine import NEG_INF_MS, POS_INF_MS, BatchStats, plan_batch
from .errors import CheckpointCorruptError, ConfigError
from .hadoopfs import HadoopFS
from .settings import Settings
from .state import EngineState
from .tables import ensure_job_tables

ProgressFn = Callable[[int, BatchStats], None]
# Called at named points of a batch ("committed:<table>", "before-state"); tests raise from it to
# simulate a crash at that point (like bytewax's ABORT() markers).
FaultFn = Callable[[str, int], None]


class StreamControl:
    """Files beside the engine state that let other processes see and stop a running stream.

    ``running`` (pid, host, query id) exists while a process runs the stream; ``stop-request``
    asks it to stop after its current batch (stop-with-savepoint uses both).
    """

    def __init__(self, spark, checkpoint: str):
        self._fs = HadoopFS(spark)
        self.running_path = f"{checkpoint}/lakestream/running"
        self.stop_path = f"{checkpoint}/lakestream/stop-request"

    def mark_running(self, query_id: str | None) -> None:
        self._fs.delete(self.stop_path)  # a request addressed to an earlier run is void
        info = {"pid": os.getpid(), "host": socket.gethostname(), "query_id": query_id, "started_ms": int(time.time() * 1000)}
        self._fs.write_text(self.running_path, json.dumps(info))

    def running(self) -> dict | None:
        """The running marker, or None. A marker left by a dead process on this host is ignored."""
        if not self._fs.exists(self.running_path):
            return None
        try:
            info = json.loads(self._fs.read_text(self.running_path))
        except ValueError:
            return None
        if info.get("host") == socket.gethostname():
            try:
                os.kill(int(info["pid"]), 0)
            except (ProcessLookupError, ValueError, KeyError, TypeError):
                return None
            except PermissionError:
                pass
        return info

    def request_stop(self) -> None:
        self._fs.write_text(self.stop_path, json.dumps({"requested_ms": int(time.time() * 1000)}))

    def stop_requested(self) -> bool:
        return self._fs.exists(self.stop_path)

    def clear(self) -> None:
        self._fs.delete(self.running_path)
        self._fs.delete(self.stop_path)


def describe_watermark(ms: int | None) -> str:
    if ms is None or ms <= NEG_INF_MS:
        return "-inf (no events yet)"
    if ms >= POS_INF_MS:
        return "+inf (end of input)"
    return iso_ms(from_epoch_ms(ms))


def print_progress(batch_id: int, stats: BatchStats) -> None:
    print(
        f"[batch {batch_id}] {stats.lines:,} lines, {stats.events:,} events, {stats.duplicates:,} duplicates, "
        f"{stats.late:,} late, {stats.quarantined:,} quarantined -> {stats.windows_written:,} windows; "
        f"watermark {describe_watermark(stats.watermark_out_ms)}",
        flush=True,
    )


@dataclass
class StreamReport:
    job: str
    batches: int = 0
    stats: BatchStats = field(default_factory=BatchStats)
    totals: BatchStats | None = None  # cumulative over the checkpoint's life
    query_id: str | None = None
    step_seconds: dict[str, float] = field(default_factory=dict)  # where the batches' time went

    def timed(self, step: str, started: float) -> float:
        now = time.perf_counter()
        self.step_seconds[step] = self.step_seconds.get(step, 0.0) + now - started
        return now


class BatchHandler:
    """The ``foreachBatch`` function of one job's stream."""

    def __init__(self, job: WindowedJob, checkpoint: str, progress: ProgressFn | None, report: StreamReport,
                 fault: FaultFn | None = None):
        self.job = job
        self._fault = fault or (lambda point, batch_id: None)
        self.checkpoint = checkpoint
        self.progress = progress
        self.report = report
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

    def __call__(self, raw: DataFrame, batch_id: int) -> None:
        spark = raw.sparkSession
        t = time.perf_counter()
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
        plan = plan_batch(
            job, raw, watermark_in_ms=watermark_in, open_windows=loaded.open_windows, seen_keys=loaded.seen_keys
        )
        t = timed("load state", t)
        try:
            stats = plan.stats()
            t = timed("parse + stats", t)
            watermark_out = plan.next_watermark()
            out = plan.finish(watermark_out)
            commit = f"{self.commit_prefix(spark)}:{batch_id}"
            props = {"lakestream.job": job.name, "lakestream.watermark-ms": str(watermark_out)}
            replay = state.has_intent(batch_id)
            emitted = out.emitted.count()
            t = timed("aggregate windows", t)
            if stats.quarantined or stats.late or emitted:
                state.mark_intent(batch_id)
            if stats.quarantined:  # a stream reads each file once: an idempotent append suffices
                sinks.append_once(plan.quarantine(), job.quarantine, commit, props, may_exist=replay)
                self._fault(f"committed:{job.quarantine.name}", batch_id)
                t = timed("commit quarantine", t)
            if stats.late:
                sinks.append_once(plan.late(), job.late_sink, commit, props, may_exist=replay)
                self._fault(f"committed:{job.late_sink.name}", batch_id)
                t = timed("commit late", t)
            if emitted:
                sinks.append_once(out.emitted, job.sink, commit, props, may_exist=replay)
                self._fault(f"committed:{job.sink.name}", batch_id)
                t = timed("commit windows", t)
            self._fault("before-state", batch_id)
            stats = BatchStats(**{**stats.__dict__, "windows_written": emitted, "watermark_out_ms": watermark_out})
            totals = loaded.record.totals.plus(stats) if loaded.record else stats
            state.save(batch_id, stats, totals, out.open_windows, out.seen_keys, job.fingerprint(), job.shape())
            t = timed("save state", t)
        finally:
            plan.release()
        self.report.batches += 1
        self.report.stats = self.report.stats.plus(stats) if self.report.batches > 1 else stats
        self.report.totals = totals
        if self.progress:
            self.progress(batch_id, stats)


def start_stream(spark, settings: Settings, job: WindowedJob, *, available_now: bool, progress: ProgressFn | None = None,
                 fault: FaultFn | None = None):
    """Start the job's streaming query; returns ``(query, report)``."""
    landing = settings.landing_dir(job.source.name)
    fs = HadoopFS(spark)
    if not fs.exists(landing):
        if settings.is_local:
            fs.mkdirs(landing)
        else:
            raise ConfigError(f"landing folder {landing} does not exist; create it or fix 'landing' in the settings")
    checkpoint = settings.checkpoint_dir(job.name)
    if fs.exists(f"{checkpoint}/metadata"):
        from .compat import check_resume

        check_resume(spark, job, checkpoint, int(spark.conf.get("spark.sql.shuffle.partitions")))
    ensure_job_tables(spark, job)
    overrides = settings.job(job.name)
    reader = spark.readStream.format("text")
    if overrides.max_files_per_trigger:
        reader = reader.option("maxFilesPerTrigger", overrides.max_files_per_trigger)
    raw = reader.load(landing).select("value", F.col("_metadata.file_path").alias("source_file"))
    report = StreamReport(job=job.name)
    writer = (
        raw.writeStream.queryName(job.name)
        .option("checkpointLocation", checkpoint)
        .foreachBatch(BatchHandler(job, checkpoint, progress, report, fault))
    )
    if available_now:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{int(overrides.trigger_interval.total_seconds() * 1000)} milliseconds")
    query = writer.start()
    report.query_id = str(query.id)
    return query, report


def stop_gracefully(query, timeout_s: float = 120.0) -> None:
    """Stop after the current micro-batch (never in the middle of one, unless it exceeds the timeout)."""
    deadline = time.monotonic() + timeout_s
    while query.isActive and query.status.get("isTriggerActive") and time.monotonic() < deadline:
        time.sleep(0.1)
    query.stop()


def run_stream(
    spark,
    settings: Settings,
    job: WindowedJob,
    *,
    available_now: bool,
    progress: ProgressFn | None = print_progress,
    stop_event: threading.Event | None = None,
    install_signal_handlers: bool = True,
    fault: FaultFn | None = None,
) -> StreamReport:
    """Run until the input is consumed (available-now) or until stopped (SIGINT/SIGTERM/``stop_event``)."""
    query, report = start_stream(spark, settings, job, available_now=available_now, progress=progress, fault=fault)
    control = StreamControl(spark, settings.checkpoint_dir(job.name))
    control.mark_running(report.query_id)
    stop = stop_event or threading.Event()
    previous = {}
    if install_signal_handlers and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        if not available_now:
            print(
                f"{job.name}: streaming from {settings.landing_dir(job.source.name)} every "
                f"{format_duration(settings.job(job.name).trigger_interval)}; Ctrl-C stops after the current batch",
                flush=True,
            )
        polls = 0
        while query.isActive:
            polls += 1
            if stop.is_set() or (polls % 4 == 0 and control.stop_requested()):
                stop_gracefully(query)
                break
            query.awaitTermination(0.5)
        if query.exception() is not None:
            raise query.exception()
    except BaseException:
        if query.isActive:  # interrupted (e.g. a Dagster run terminated): stop after the current batch
            stop_gracefully(query)
        raise
    finally:
        control.clear()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return report
