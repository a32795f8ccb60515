"""Backfill: recompute a job over ``[start, end)`` of event time with its bounded twin (``bounded``)
and make the job's tables hold that result, Iceberg and Delta alike.

* **main table**: the rows of the range are replaced atomically (one commit), validated against
  concurrent writers and retried on a conflict;
* **late side output**: nothing is late in a bounded run, so the late rows of the range whose
  events the run consumed are deleted (the main table now counts them). Late rows of events the
  run did not see (written by the live stream meanwhile) stay;
* **quarantine**: lines quarantined by the run are added unless already present.

Running it again gives the same rows (and no new data files beyond the replace).

**Who owns which partitions.** The live stream owns every window it may still write: those not
yet final under its watermark ``W`` and allowed lateness ``L``. A backfill refuses a range that
reaches past the stream's *final horizon* unless ``force=True`` (then the stream's later writes to
those windows win, or duplicate them if it appends):

* tumbling/sliding windows: the range must end by ``W - L - size + every`` (every window starting
  before the end has ``end + L <= W``);
* sessions: as above with the gap, and no session open in the stream's state may start before
  the end of the range;
* keyed jobs: the range must end by ``W`` (later outputs come from later elements and timers).
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Callable

from pyspark.sql import Observation
from pyspark.sql import functions as F

from streaming.declaration import Job, KeyedJob
from streaming.time import epoch_ms, from_epoch_ms, is_finite, iso_ms
from streaming.checkpoint.records import BatchStats
from streaming.errors import DateRangeError, OwnershipError
from streaming.settings import Settings
from streaming.checkpoint.records import EngineState
from streaming.checkpoint.tree import file_key
from streaming.spark.jvm import cached_leaf
from streaming.spark.metrics import observe, observed
from streaming.io.schemas import late_time_column, main_time_column
from streaming.io.tables import TablesPending, job_sinks

from .bounded import compute, read_landing  # noqa: F401 - read_landing is part of this module's API

DAY_MS = 86_400_000
_RUNS = itertools.count()


@dataclass(frozen=True)
class BackfillReport:
    job: str
    start: datetime
    end: datetime
    stats: BatchStats
    seconds: float
    partitions: int  # day partitions replaced per table
    reconciliation: object | None = None  # the stream compared with the bounded result, before the replace

    @property
    def events_per_second(self) -> float:
        return self.stats.lines / self.seconds if self.seconds else 0.0


def check_range(start: datetime, end: datetime) -> None:
    if end <= start:
        raise DateRangeError(
            f"empty range: --end {end.isoformat()} is not after --start {start.isoformat()}; the range is [start, end)"
        )


def final_horizon_ms(spark, settings: Settings, job: Job, *, lateness: bool = True) -> int | None:
    """The event time before which the stream will write nothing more (None: no stream yet). ``lateness=False``:
    before which every window (keyed: every output) has been written at least once."""
    record = EngineState(spark, settings.checkpoint_dir(job.name)).latest_record()
    if record is None:
        return None
    w = record.watermark_ms
    if isinstance(job, KeyedJob):
        return w
    # the pieces the stream still holds begin where the store's manifest says (no read needed)
    open_starts = [f.lo for f in record.store.of_kind("pieces")]
    return job.window.final_horizon_ms(w, job.watermark.allowed_lateness_ms if lateness else 0, open_starts)


@dataclass
class Ownership:
    """What a backfill may replace beside the job's stream: ``[lo, hi_ms)``; ``lease``: the job's lease, held
    while it writes windows a stopped stream still holds open (recorded as a forced range: the stream, when it
    resumes, upserts them instead of appending them again)."""

    hi_ms: int
    lease: object | None = None
    forced_range: tuple[int, int] | None = None


def ownership(spark, settings: Settings, job: Job, lo_ms: int, hi_ms: int, force: bool,
              say: Callable[[str], None]) -> Ownership:
    """Who writes which windows of ``[lo, hi)``: the stream owns every window it may still write (past its
    final horizon). While the stream runs, such a range is refused without ``force``. Forced, or when the stream
    is stopped, the windows the stream has already written are replaced (a stream that corrects a window later
    upserts it: its write wins); the windows it still holds open are left to a running stream (it appends them
    when they close) and written for a stopped one, which then upserts them when it resumes. Keyed outputs
    have no key to upsert on: they are left to the stream past its watermark, running or not."""
    from streaming.checkpoint.lease import Lease

    horizon = final_horizon_ms(spark, settings, job)
    if horizon is None or hi_ms <= horizon:
        return Ownership(hi_ms)
    lease = Lease(settings.checkpoint_dir(job.name), settings.storage_options, job=job.name)
    holder = lease.holder()
    where = iso_ms(from_epoch_ms(horizon)) if is_finite(horizon) else "the beginning (no window is final yet)"
    state = f"running ({holder.describe()})" if holder is not None else "stopped"
    if not force and holder is not None:
        raise OwnershipError(
            f"{job.name}: the range ends at {iso_ms(from_epoch_ms(hi_ms))}, but its stream ({state}) may still write "
            f"windows starting after {where} (its watermark minus allowed lateness); backfill an earlier range, or "
            "let the stream reach the range's end; forcing replaces what the stream has written and leaves it the "
            "windows it still holds open")
    written = final_horizon_ms(spark, settings, job, lateness=False)
    if holder is None and not isinstance(job, KeyedJob):
        lease.acquire("backfill")  # (no stream starts while the range is recorded and written)
        say(f"{job.name}: {'forced: ' if force else ''}its stream is stopped; the windows of the range it still holds "
            "open are written now, and the stream upserts them when it resumes")
        return Ownership(hi_ms, lease, (lo_ms, hi_ms))
    cut = max(lo_ms, min(hi_ms, written))
    say(f"{job.name}: {'forced: ' if force else ''}replacing [{iso_ms(from_epoch_ms(lo_ms))}, {iso_ms(from_epoch_ms(cut))}); "
        f"{'windows' if not isinstance(job, KeyedJob) else 'outputs'} from {iso_ms(from_epoch_ms(cut))} on are left "
        f"to the {'running' if holder is not None else 'stopped'} stream, which writes them "
        f"{'when they close' if not isinstance(job, KeyedJob) else 'as their elements and timers come'}")
    return Ownership(cut)


def day_partitions(lo_ms: int, hi_ms: int) -> int:
    return len(range(lo_ms - lo_ms % DAY_MS, hi_ms, DAY_MS))


def backfill(spark, settings: Settings, job: Job, start: datetime, end: datetime, *,
             progress: Callable[[str], None] | None = print, force: bool = False,
             reconcile_first: bool = False) -> BackfillReport:
    """Recompute ``job`` over ``[start, end)`` and make every sink table hold that result.

    ``reconcile_first`` also compares what the stream wrote with the bounded result before
    replacing it (the same computation serves both), recorded in ``lake.ops.reconciliation``.
    """
    say = progress or (lambda _m: None)
    check_range(start, end)
    lo, hi = epoch_ms(start), epoch_ms(end)
    owner = ownership(spark, settings, job, lo, hi, force, say)
    try:
        return _backfill(spark, settings, job, start, end, lo, owner, say, reconcile_first)
    finally:
        if owner.lease is not None:
            owner.lease.release()


def _backfill(spark, settings: Settings, job: Job, start: datetime, end: datetime, lo: int, owner: Ownership,
              say: Callable[[str], None], reconcile_first: bool) -> BackfillReport:
    hi = owner.hi_ms
    started = time.monotonic()
    if hi <= lo:
        say(f"{job.name}: nothing of [{iso_ms(start)}, {iso_ms(end)}) to replace: the stream still writes all of it")
        return BackfillReport(job=job.name, start=start, end=end, stats=BatchStats(), seconds=0.0, partitions=0)
    if owner.forced_range is not None:  # recorded before anything is written: the stream upserts there on resume
        state = EngineState(spark, settings.checkpoint_dir(job.name))
        state.save_forced_ranges([*state.forced_ranges(), owner.forced_range])
    # The tables are created or checked while the range is read (see ``io.tables.TablesPending``); nothing is
    # written to them before they exist
    pending = TablesPending(spark, settings, job)
    sinks = job_sinks(spark, settings, job, create=False)
    days = day_partitions(lo, hi)
    tables = 2 + len(job.sources)
    say(f"{job.name}: backfill [{iso_ms(start)}, {iso_ms(end)}): {days} day partition(s) in each of {tables} tables")
    result = compute(spark, settings, job, lo, hi, say)
    props = {"lakestream.job": job.name, "lakestream.backfill": f"{iso_ms(start)}/{iso_ms(end)}"}
    reconciliation = None
    try:
        # The quarantine's commits are independent of the main table's: they start now and run beside its pass
        # (their reads of the cached lines and their commit latency overlap it). The late table's follows the
        # main table's commit: it removes late rows whose events the main table now counts.
        from streaming.run.side import side_rows_committed

        pending.wait()
        side_rows_committed(spark, settings, job, say, lease=owner.lease)  # (what the stream keeps, in its tables)
        read = _read_by_stream(settings, job)
        with ThreadPoolExecutor(max_workers=len(result.quarantine) + 1, thread_name_prefix=f"backfill-{job.name}") as pool:
            quarantined = [pool.submit(_quarantine, sinks, result, source, frame, props, read)
                           for source, frame in result.quarantine.items()]
            main, rows_seen = result.main, None
            if reconcile_first and EngineState(spark, settings.checkpoint_dir(job.name)).latest_record() is not None:
                from .reconcile import compare, record_results, stream_watermark

                main = main.cache()  # read by the comparison, then written
                rows = main.count()
                reconciliation = compare(spark, settings, job, result, stream_watermark(spark, settings, job), start, end)
                record_results(spark, settings, reconciliation)
            else:  # one pass reads the events, counts the rows and writes the range (no cache, no separate count)
                rows_seen = Observation(f"backfill-{job.name}-{next(_RUNS)}")
                main = observe(main, rows_seen, [F.count(F.lit(1)).alias("n")])
            sinks.main.replace_range(main, main_time_column(job), lo, hi, props)
            if rows_seen is not None:
                rows = int(observed(rows_seen)["n"] or 0)
            main.unpersist()
            stats = result.final_stats()
            seconds = time.monotonic() - started
            say(f"  read {stats.lines:,} lines ({stats.lines / max(seconds, 1e-9):,.0f} lines/s), {stats.events:,} "
                f"events for the range, {stats.quarantined:,} quarantined, {stats.duplicates:,} duplicate(s) dropped")
            if reconciliation is not None:
                say(f"  the stream before the replace: {reconciliation.unexplained} unexplained difference(s)\n"
                    + reconciliation.table())
            say(f"  [1/{tables}] {sinks.main.table.name}: {days}/{days} day partition(s) replaced, {rows:,} rows")
            late = pool.submit(_absorb_late, sinks, result, job, lo, hi, props)
            for done, step in enumerate([*quarantined, late], start=2):
                say(f"  [{done}/{tables}] {step.result()}")
        seconds = time.monotonic() - started
        say(f"  done in {seconds:.1f} s ({stats.lines / max(seconds, 1e-9):,.0f} lines/s overall)")
        stats = replace(stats, rows_written=rows)
    finally:
        result.release()
    return BackfillReport(job=job.name, start=start, end=end, stats=stats, seconds=time.monotonic() - started,
                          partitions=days, reconciliation=reconciliation)


def _quarantine(sinks, result, source: str, frame, props, read_by_stream: set[str] | None) -> str:
    """Add the run's quarantined lines that this job's rows of the table lack. ``read_by_stream``: the landing
    files the job's stream has read (None: no stream, or a source without landing files); lines of other
    files are left to the stream, which quarantines them when it reads them (both would be one too many)."""
    name = sinks.quarantine[source].table.name
    if result.quarantined(source) == 0:  # (None: not counted apart, so written)
        return f"{name}: nothing quarantined, left as it is"
    if read_by_stream is not None:
        files = [r.source_file for r in frame.select("source_file").distinct().collect()]
        mine = [f for f in files if f is not None and file_key(f) in read_by_stream]
        if len(mine) < len(files):
            frame = frame.where(F.col("source_file").isin(mine))
    frame = frame.withColumn("written_by", F.lit(f"backfill:{props['lakestream.backfill']}"))
    sinks.quarantine[source].insert_missing(frame, ("source_file", "raw_line", "detected_by"), props)
    return f"{name}: quarantined lines added where missing"


def _read_by_stream(settings: Settings, job: Job) -> set[str] | None:
    """The landing files the job's stream has read, as ``file_key`` names them (None: it never ran, or it
    reads no landing folder)."""
    from streaming.checkpoint.inspect import inspect_job

    from streaming.io.sources import kind_of

    if not any(kind_of(s).lands_in_folder for s in job.sources):
        return None
    report = inspect_job(settings, job)
    return set(report.consumed_files) if report.exists else None


def _absorb_late(sinks, result, job: Job, lo: int, hi: int, props) -> str:
    """Delete the range's late rows whose events the run consumed (the main table now counts them)."""
    late_column, key = late_time_column(job), job.source.dedup_key
    t = F.unix_millis(F.col(late_column))
    late_rows = sinks.late.read().where((t >= lo) & (t < hi)).select(key, late_column).cache()
    absorbed_n = 0
    try:
        if late_rows.count():  # (the range's events are read again only when late rows could match them)
            absorbed = late_rows.join(result.consumed, key, "left_semi").cache()
            absorbed_n = absorbed.count()
            if absorbed_n:  # (as the cache alone: the events' plan numbers lines, which a MERGE refuses to read)
                sinks.late.delete_keys(cached_leaf(absorbed), (key, late_column), props)
            absorbed.unpersist()
    finally:
        late_rows.unpersist()
    return f"{sinks.late.table.name}: {absorbed_n:,} late row(s) of the range removed (the bounded result counts their events)"
