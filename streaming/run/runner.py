"""Run a job as a stream: Spark's file source per landing folder, the job's plan, ``foreachBatch``.

Windowed jobs hand the raw lines of each micro-batch to the event-time engine
(``run.commit.WindowedHandler``); keyed jobs run the keyed runtime on Spark's state store
(``spark.keyed``) and commit its outputs in ``run.commit.KeyedHandler``. Either way each table is
committed exactly once per batch (see ``run.commit``).
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
import time
from datetime import timedelta
from typing import Callable

from pyspark.sql import DataFrame

from ..checkpoint.lease import Lease
from ..declaration import Job, KeyedJob
from ..time import describe_watermark, format_duration
from ..io.sources import kind_of, stream_all
from ..errors import ConfigError
from .commit import BatchResult, FaultFn, ProgressFn, SnapshotExpiry, StreamReport
from .keyed import KeyedHandler
from .windowed import WindowedHandler
from ..spark.hadoopfs import HadoopFS
from ..checkpoint.layout import Layout
from ..spark.session import stream_session
from ..keyed.function import PROCESSING_TIME
from ..settings import Settings
from ..io.tables import TablesPending, job_sinks

log = logging.getLogger(__name__)


def print_progress(result: BatchResult) -> None:
    if result.outside_batch:  # (said as it was committed)
        return
    s = result.stats
    print(
        f"[{result.job} batch {result.batch_id}] {s.lines:,} lines, {s.events:,} events, {s.duplicates:,} duplicates, "
        f"{s.late:,} late rows, {s.quarantined:,} quarantined -> {s.rows_written:,} rows written"
        + (f", {s.rows_deleted:,} deleted" if s.rows_deleted else "")
        + f"; watermark {describe_watermark(s.watermark_out_ms)} ({result.seconds:.1f}s)",
        flush=True,
    )


def snapshot_expiry(settings: Settings, job: Job, sinks, say=None) -> SnapshotExpiry | None:
    """The expiry of the snapshots of ``job``'s own Iceberg tables (main, late) during its stream; none of a table
    that a job of the project reads as its source (its stream's offsets name snapshots of it)."""
    try:
        from ..project import registry

        read = {t.lower() for j in registry(settings).values() for src in j.sources
                for t in [kind_of(src).upstream_table(src)] if t}
    except Exception:  # noqa: BLE001 - the project's jobs unknown here: expire nothing rather than guess
        return None
    own = [s for s in (sinks.main, sinks.late) if s.format == "iceberg" and s.table.name.lower() not in read]
    if not own:
        return None
    return SnapshotExpiry(own, int(settings.iceberg.snapshot_retention.total_seconds() * 1000),
                          settings.iceberg.expire_every.total_seconds(), say=say)


def _say(progress):
    return (lambda text: print(text, flush=True)) if progress else None


def settle_side_outputs(spark, r, progress, *, at_stop: bool = False, only_if_due: bool = False) -> None:
    """Commit the side rows a windowed stream keeps (``run.side``): at its stop (before its lease goes), or while
    it idles with rows due. A failure while idle is logged and tried again; at the stop it is raised."""
    handler = getattr(r.report, "handler", None)
    if not isinstance(handler, WindowedHandler):
        return
    try:
        handler.settle(spark, at_stop=at_stop, only_if_due=only_if_due, say=_say(progress) if at_stop else None)
    except Exception as exc:  # noqa: BLE001 - idle housekeeping: the next batch or the stop commits them
        if not only_if_due:
            raise
        log.warning("%s: could not commit its side rows while idle (%s); the next batch or the stop will",
                    r.job.name, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def raw_stream(spark, settings: Settings, job: Job) -> DataFrame:
    """The records of every source of ``job`` as one stream (see ``io.sources``), read in the stream's own
    copy of the session."""
    folders = [kind_of(s).landing_folder(settings, s) for s in job.sources]
    return stream_all(stream_session(spark, settings, [f for f in folders if f]), settings, job)


def start_stream(spark, settings: Settings, job: Job, *, available_now: bool, progress: ProgressFn | None = None,
                 fault: FaultFn | None = None, lease: Lease | None = None):
    """Start the job's streaming query; returns ``(query, report)``."""
    checkpoint = settings.checkpoint_dir(job.name)
    fs = HadoopFS(spark)
    resuming = fs.exists(Layout(checkpoint).metadata)
    from ..checkpoint.compat import check_resume, stored_shuffle_partitions, stream_partitions

    partitions = stream_partitions(spark, job, stored_shuffle_partitions(fs, checkpoint) if resuming else None)
    if resuming:
        check_resume(spark, job, checkpoint, partitions)
    # The tables are created or checked on a thread of their own while the query starts and its first batch runs;
    # its first commit waits for them (a fresh home's four tables took ~1.4 s on the critical path of a cold start)
    tables = TablesPending(spark, settings, job)
    sinks = job_sinks(spark, settings, job, create=False)
    raw = raw_stream(spark, settings, job)
    report = StreamReport(job=job.name)
    if isinstance(job, KeyedJob):
        from ..io.parse import parse_sources
        from ..spark.keyed import bucket_labels, key_buckets, main_schema, stream_frame
        from ..checkpoint.records import EngineState

        record = EngineState(spark, checkpoint).latest_record() if resuming else None
        buckets = key_buckets(record.key_buckets if record else None, record is not None, partitions)
        labels = bucket_labels(record, buckets, partitions)
        stream = stream_frame(job, parse_sources(job, raw), buckets, labels, store=Layout(checkpoint).keys,
                              options=settings.storage_options)
        handler = KeyedHandler(job, checkpoint, sinks, progress, report, fault, lease, main_schema=main_schema(job),
                               key_buckets=buckets, bucket_labels=labels)
    else:
        from ..io.tables import store_schemas

        stream = raw
        handler = WindowedHandler(job, checkpoint, sinks, progress, report, fault, lease,
                                  store_schemas=store_schemas(spark, job), storage_options=settings.storage_options,
                                  side_every_ms=int(settings.side_outputs_every_of(job.name).total_seconds() * 1000))
    handler.pending_tables = tables
    handler.before_start(spark, resuming)
    report.handler = handler
    if resuming and isinstance(handler, WindowedHandler):  # side rows a crash left in the checkpoint
        handler.settle(spark, say=_say(progress))
    handler.expiry = snapshot_expiry(settings, job, sinks, say=_say(progress))
    writer = stream.writeStream.queryName(job.name).option("checkpointLocation", checkpoint).foreachBatch(handler)
    interval = trigger_interval(settings, job)
    if available_now and not _polls(job) and not _paced_tables(settings, job):
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{int(interval.total_seconds() * 1000)} milliseconds")
    query = _start_with_partitions(stream.sparkSession, writer, partitions)  # (the session of its sources)
    report.query_id = str(query.id)
    return query, report


def _start_with_partitions(spark, writer, partitions: int):
    """Start the query with ``partitions`` shuffle partitions: Spark clones the session when the query
    is created and takes a new stream's count from the clone (a resumed one takes its offset log's)."""
    configured = spark.conf.get("spark.sql.shuffle.partitions")
    if int(configured) == partitions:
        return writer.start()
    spark.conf.set("spark.sql.shuffle.partitions", str(partitions))
    try:
        return writer.start()
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", configured)


# A job with processing-time timers runs a batch every trigger, input or not: without an interval of its own it
# ticks once a second (a trigger of 0 would run batches back to back on an idle stream).
PROCESSING_TIME_TICK = timedelta(seconds=1)


def trigger_interval(settings: Settings, job: Job) -> timedelta:
    """The job's trigger interval: its setting (default 0: the next batch starts as soon as the last one has
    committed and input is waiting, Spark's own default), or ``PROCESSING_TIME_TICK`` for a job with
    processing-time timers that sets none."""
    interval = settings.job(job.name).trigger_interval
    if interval is None:
        return PROCESSING_TIME_TICK if _polls(job) else timedelta(0)
    return interval


def _polls(job: Job) -> bool:
    """Processing-time timers need Spark to run batches without data, which availableNow never
    ends: such jobs run on a processing-time trigger and stop when the input is drained."""
    return isinstance(job, KeyedJob) and job.timers == PROCESSING_TIME


def _paced_tables(settings: Settings, job: Job) -> bool:
    """A table source with ``max_files_per_trigger``: Iceberg's stream (1.10) ignores read limits under
    availableNow and reads everything in one batch, so such a run uses a processing-time trigger and
    stops when the input is drained."""
    limit = settings.job(job.name).max_files_per_trigger
    return any(kind_of(s).paced_under_available_now(limit) for s in job.sources)


def _drained(query, elapsed_s: float, timers: bool = True) -> bool:
    """No input waits and the last batch read none (so the timers the input made due have fired);
    without timers, no input waits after a batch."""
    status = query.status
    if status.get("isDataAvailable") or status.get("isTriggerActive"):
        return False
    last = query.lastProgress
    if not timers:
        return last is not None or elapsed_s > 10
    if last is None:
        return elapsed_s > 10
    return last.get("numInputRows", 0) == 0


def stop_gracefully(query, report: StreamReport | None = None, timeout_s: float = 120.0) -> None:
    """Stop after the current micro-batch (never in the middle of one, unless it exceeds the timeout).

    The stop happens while no batch runs, or, when batches follow each other without a pause (a
    job with processing-time timers runs one per trigger), as soon as Spark has recorded the
    running batch as committed; a batch that has just begun is then interrupted and replayed on
    the next start (every sink is exactly-once).
    """
    deadline = time.monotonic() + timeout_s
    if report is not None:
        report.batch_done.clear()
    while query.isActive and query.status.get("isTriggerActive") and time.monotonic() < deadline:
        if report is not None and report.batch_done.is_set() and report.last is not None:
            done = report.last.batch_id
            recorded = lambda: (query.lastProgress or {}).get("batchId", -1) >= done  # noqa: E731
            while query.isActive and query.status.get("isTriggerActive") and not recorded() \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
            break
        time.sleep(0.02)
    query.stop()


def _stop_on_signal(received: list[str], stop: threading.Event, signum: int, _frame) -> None:
    received.append(signal.Signals(signum).name)
    stop.set()


def take_signals(received: list[str], stop: threading.Event) -> dict:
    """Take SIGINT and SIGTERM as stop requests (their names recorded in ``received``, ``stop`` set) until
    :func:`restore_signals`; returns the handlers they replace (none outside the main thread, where signals
    cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, functools.partial(_stop_on_signal, received, stop))
            for sig in (signal.SIGINT, signal.SIGTERM)}


def restore_signals(previous: dict) -> None:
    """Put back the handlers :func:`take_signals` replaced (each once, however often this is called)."""
    while previous:
        sig, handler = previous.popitem()
        signal.signal(sig, handler)


def run_stream(spark, settings: Settings, job: Job, *, available_now: bool,
               progress: ProgressFn | None = print_progress, stop_event: threading.Event | None = None,
               install_signal_handlers: bool = True, fault: FaultFn | None = None,
               tick: Callable[[object], None] | None = None) -> StreamReport:
    """Run one job as a stream; see ``run_streams``."""
    return run_streams(spark, settings, [job], available_now=available_now, progress=progress, stop_event=stop_event,
                       install_signal_handlers=install_signal_handlers, fault=fault, tick=tick)[0]


def _tables_error(r, wait: bool = False) -> BaseException | None:
    """What the creation of a stream's tables raised (``io.tables.TablesPending``), once it ended (``wait``: for it
    to end, when the stream failed: its error is then the cause)."""
    tables = getattr(r.report.handler, "pending_tables", None)
    return None if tables is None else tables.error(wait=wait)


class _Running:
    def __init__(self, job: Job, query, report: StreamReport, lease: Lease):
        self.job, self.query, self.report, self.lease = job, query, report, lease


def take_lease(spark, settings: Settings, job: Job, lease: Lease | None = None) -> Lease:
    """The job's lease for its stream (``lease``: already taken, e.g. by a restore before the start). A restore
    that began and did not finish is finished first (see ``checkpoint.savepoints``)."""
    lease = lease or Lease(settings.checkpoint_dir(job.name), settings.storage_options, job=job.name).acquire("stream")
    pending = lease.pending_restore()
    if pending:
        from ..checkpoint.savepoints import Savepoints

        print(f"{job.name}: finishing the interrupted restore of savepoint {pending}", flush=True)
        Savepoints(spark, settings).restore(job, pending, lease=lease)
    return lease


def run_streams(
    spark,
    settings: Settings,
    jobs: list[Job],
    *,
    available_now: bool,
    progress: ProgressFn | None = print_progress,
    stop_event: threading.Event | None = None,
    install_signal_handlers: bool = True,
    fault: FaultFn | None = None,
    tick: Callable[[object], None] | None = None,
    stop_together: bool = False,
    leases: dict[str, Lease] | None = None,
) -> list[StreamReport]:
    """Run jobs as streaming queries of one Spark application, until the input is consumed
    (available-now) or until stopped (SIGINT/SIGTERM/``stop_event``: every query stops after its
    current batch). A stop request addressed to one job (stop-with-savepoint) stops that query only,
    or every query with ``stop_together``; a query that fails stops the others gracefully and its
    error is raised.

    ``progress`` is called after each committed batch, on Spark's batch thread, and after a commit of side rows
    kept by earlier batches (``BatchResult.outside_batch``, ``run.side``), on the thread that made it; ``tick(query)`` is
    called about twice a second per query (and once at the end) on the calling thread, e.g. to
    publish progress from there.

    Each job's stream holds the job's lease (``checkpoint.lease``) while it runs: a second runner of a job is
    refused in one line naming the holder. ``leases``: leases already taken (by name), e.g. by a restore.
    """
    names = [job.name for job in jobs]
    if len(set(names)) != len(names):
        raise ConfigError(f"a job can run only once per application; got {', '.join(names)}")
    stop = stop_event or threading.Event()
    started: list[_Running] = []
    held: list[Lease] = []
    reports: list[StreamReport] = []
    received: list[str] = []  # the signals that asked to stop
    previous = take_signals(received, stop) if install_signal_handlers else {}
    try:
        for job in jobs:  # every lease first: a refusal changes nothing
            held.append(take_lease(spark, settings, job, (leases or {}).get(job.name)))
        for job, lease in zip(jobs, held):
            lease.keep_alive()
            query, report = start_stream(spark, settings, job, available_now=available_now, progress=progress,
                                         fault=fault, lease=lease)
            started.append(_Running(job, query, report, lease))
            reports.append(report)
            if not available_now and progress is not None:
                folders = ", ".join(kind_of(s).location(settings, s) for s in job.sources)
                interval = trigger_interval(settings, job)
                pace = f"every {format_duration(interval)}" if interval else "as input arrives"
                print(f"{job.name}: streaming from {folders} {pace}; Ctrl-C stops after the current batch", flush=True)
        running = list(started)
        polls = 0
        began = time.monotonic()
        while running:
            polls += 1
            if stop_together and polls % 4 == 0 and any(r.lease.stop_requested() for r in running):
                stop.set()
            for r in list(running):
                failed = _tables_error(r)
                if failed is not None:  # (the batch waiting for them fails too: this is its cause, said plainly)
                    raise failed
                if not r.query.isActive:
                    running.remove(r)
                    if r.query.exception() is not None:
                        raise _tables_error(r, wait=True) or r.query.exception()
                    settle_side_outputs(spark, r, progress, at_stop=True)
                    r.lease.release()
                elif stop.is_set() or (polls % 4 == 0 and r.lease.stop_requested()) or (
                        available_now and (_polls(r.job) or _paced_tables(settings, r.job))
                        and _drained(r.query, time.monotonic() - began, timers=_polls(r.job))):
                    stop_gracefully(r.query, r.report)
                    running.remove(r)
                    settle_side_outputs(spark, r, progress, at_stop=True)
                    r.lease.release()  # a savepoint waiting for this job may go on
                elif polls % 4 == 2 and not r.query.status.get("isTriggerActive"):
                    settle_side_outputs(spark, r, progress, only_if_due=True)  # an idle stream's side rows
            if running:
                running[0].query.awaitTermination(0.5)
                if tick is not None:
                    for r in running:
                        tick(r.query)
        for r in started:
            if r.query.exception() is not None:
                raise _tables_error(r, wait=True) or r.query.exception()
            r.report.handler.tables_ready()  # (a stream that committed nothing leaves its tables created all the same)
    except BaseException:
        for r in started:
            if r.query.isActive:  # interrupted, or another query failed: stop after the current batch
                stop_gracefully(r.query, r.report)
        raise
    finally:
        for lease in held:
            lease.release()
        for r in started:
            r.report.signal = received[0] if received else None
        restore_signals(previous)
        if tick is not None:
            for r in started:
                tick(r.query)
    return reports
