"""``foreachBatch`` of a windowed job: the event-time batch (``windowed``) over the incremental store, then
its commits, exactly once per table (see ``commit``)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ..checkpoint.records import watermark_of
from ..checkpoint.store import Store
from ..declaration import WindowedJob
from ..io.sinks import OP
from ..spark.columns import once
from ..windowed.batch import INTERPRETED_BATCH_LINES, SMALL_BATCH_LINES, plan_batch
from ..windowed.compaction import Compaction, compact, compaction_due, maintain
from ..windows.fixed import FixedWindows
from . import side
from ..checkpoint.records import BatchStats
from .commit import INTERPRETED, ONE_PARTITION, BatchResult, Handler, Output, count_span, override, restore


SMALL_SIDE_ROWS = 100_000  # side rows kept in the checkpoint by one task (one file per folder)


class WindowedHandler(Handler):
    """``foreachBatch`` of a windowed job: the engine's batch over the incremental store, then the commits."""

    job: WindowedJob

    def __init__(self, *args, store_schemas: dict, storage_options: dict | None = None, side_every_ms: int = 0,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.store_schemas = store_schemas
        self.storage_options = dict(storage_options or {})
        self.side_every_ms = side_every_ms  # how often the side outputs are committed (``run.side``; 0: every batch)
        self.lock = threading.Lock()  # held by a batch, and by a commit of pending side rows outside one
        self._forced_ranges: list[tuple[int, int]] | None = None

    def settle(self, spark, *, at_stop: bool = False, only_if_due: bool = False, say=None) -> int:
        """Commit the side rows the newest record keeps, outside any batch (``run.side.commit_pending``): before the
        stream starts (a crash left them), when it stops, or while it idles with rows due (``only_if_due``: then
        only if no batch runs). Returns how many rows it committed."""
        if only_if_due:
            if not self.lock.acquire(blocking=False):
                return 0
        else:
            self.lock.acquire()
        try:
            if only_if_due and (self.records is None or self.records.latest() is None):
                return 0  # (no batch of this run yet: what a crash left was committed at the start)
            self._start(spark)
            if at_stop:
                candidate = self.state.replay_candidate()  # (a batch the stop interrupted)
            elif self.records.latest() is None:
                candidate = self._replay  # before this run's first batch
            else:
                candidate = None  # between two batches of this run: the last one ended
            # A batch Spark will replay starts again from the record before it: that record's side rows are
            # the ones to commit (a record of the batch itself, if written, is rewritten by the replay).
            if candidate is not None:
                record = self.state.latest_record_before(candidate)
            else:
                record = self.records.latest() or self.state.latest_record()
            if record is None or not record.pending or (only_if_due and not side.due(record.pending, self.side_every_ms)):
                return 0
            self.tables_ready()
            if self.lease is not None:
                self.lease.check()
            started = time.perf_counter()
            settled, tables = side.commit_pending(spark, self.state, record, self.sinks, self._prefix, self.job.name,
                                                  candidate=candidate, fault=self._fault, say=say)
            self.records.committed(settled)
            if self.progress and tables:  # (Dagster: the side tables' materializations, the watermark)
                w = settled.watermark_ms
                self.progress(BatchResult(self.job.name, settled.batch_id, BatchStats(watermark_in_ms=w, watermark_out_ms=w),
                                          time.perf_counter() - started, tables, int(time.time() * 1000),
                                          sum((settled.state_rows or {}).values()) or None, outside_batch=True))
            return sum(p.rows for p in record.pending)
        finally:
            self.lock.release()

    def _commit_quarantine(self, batch, commit, batch_id: int, prior) -> dict:
        """Commit the batch's quarantined lines with those earlier batches kept (stamped with this commit)."""
        spark = batch.parsed.sparkSession
        outputs = []
        for source, n in batch.quarantined_by_source.items():
            sink = self.sinks.quarantine[source]
            earlier = side.of_table(prior, sink.table.name)
            frame = batch.quarantine(source, commit.id, batch_id) if n else None
            if earlier:
                stamped = side.read_pending(spark, earlier, commit.id, batch_id)
                frame = stamped if frame is None else stamped.unionByName(frame)
            outputs.append(Output(sink, frame, n + sum(p.rows for p in earlier)))
        return self.write(outputs, commit, batch_id)

    def _keep_quarantine(self, batch, commit, batch_id: int, prior) -> list:
        """Write the batch's quarantined lines into the checkpoint (``run.side``), unstamped."""
        spark = batch.parsed.sparkSession
        kept = []
        for source, n in batch.quarantined_by_source.items():
            if n:
                made = side.write_pending(spark, self.layout, batch_id, self.sinks.quarantine[source].table.name,
                                          batch.quarantine(source), n <= SMALL_SIDE_ROWS)
                if made is not None:
                    kept.append(made)
        return kept

    def _forced(self, spark) -> list[tuple[int, int]]:
        """The checkpoint's forced ranges, read once per run (a forced backfill writes them only while no stream
        holds the job's lease)."""
        if self._forced_ranges is None:
            self._forced_ranges = self.state.forced_ranges()
        return self._forced_ranges

    def __call__(self, raw: DataFrame, batch_id: int) -> None:
        with self.lock:
            self._batch(raw, batch_id)

    def _batch(self, raw: DataFrame, batch_id: int) -> None:
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
        self.begin(spark, batch_id)
        self._fault("batch-start", batch_id)
        job = self.job
        previous = self.previous(batch_id)
        w_in = watermark_of(previous)
        # Windows a forced backfill wrote while the stream was stopped may be in the table already: while one of
        # them can still fire, the batch writes its windows as upserts (see ``batch.backfill``).
        open_starts = [f.lo for f in previous.store.of_kind("pieces")] if previous is not None else []
        horizon = job.window.final_horizon_ms(w_in, job.watermark.allowed_lateness_ms, open_starts)
        forced = [r for r in self._forced(spark) if r[1] > horizon]
        store = Store(spark, self.layout, previous.store if previous is not None else None, self.store_schemas,
                      self.storage_options)
        batch = plan_batch(job, raw, watermark_in_ms=w_in, store=store, batch_id=batch_id,
                           lines_before=previous.stats.lines if previous is not None else None)
        stored = quarantined = lated = None
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
                override(spark, ONE_PARTITION, before)
                if stats.lines <= INTERPRETED_BATCH_LINES:
                    override(spark, INTERPRETED, before)
            else:
                # foreachBatch runs in the stream's session clone, where Spark turns AQE off for the sake of
                # stateful operators. A windowed job's stream has none, so adaptive execution is safe here.
                spark.conf.set("spark.sql.adaptive.enabled", "true")
            t = timed("parse + stats", t)
            commit = self.commit(batch_id, w_out)
            # The side outputs are committed every ``side_outputs_every`` (``run.side``): until then each batch
            # writes its side rows into the checkpoint. A batch Spark may be replaying commits them: its first
            # attempt may have.
            prior = previous.pending if previous is not None else ()
            flush = not self.side_every_ms or batch_id == self._replay or side.due(prior, self.side_every_ms)
            # Four strands overlap: the quarantine's commit (it reads nothing but the cached lines) starts
            # now; the late rows' commit once they are planned (before the firing: in a small batch the late
            # table's commit was the last to end); the store's write once the firing is planned; the fired
            # windows and their commit on this thread. None of them reads what another adds.
            pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix=f"batch-{job.name}")
            quarantined = pool.submit(self._commit_quarantine if flush else self._keep_quarantine,
                                      batch, commit, batch_id, prior)
            late = None
            late_name = self.sinks.late.table.name
            kept_late = side.of_table(prior, late_name) if flush else []
            may_be_late = batch.may_be_late()  # only a batch with events behind the watermark has late rows
            if may_be_late or kept_late:
                frame = batch.late() if may_be_late else None
                expected = (batch.late_candidates() * job.window.windows_per_event if may_be_late else 0) \
                    + sum(p.rows for p in kept_late)
                if kept_late:
                    earlier = side.read_pending(spark, kept_late)
                    frame = earlier if frame is None else earlier.unionByName(frame)
                if flush:  # counted as written
                    late = Output(self.sinks.late, frame, None, span="window_start", expected=expected)
                    lated = pool.submit(self.write, [late], commit, batch_id)
                else:
                    lated = pool.submit(side.write_pending, spark, self.layout, batch_id, late_name, frame,
                                        expected <= SMALL_SIDE_ROWS)
            fired = batch.fire(w_out)
            # (a tumbling or sliding window's pieces are one row per key and window: few enough to collect, mostly;
            # a session's merge earlier sessions in and are left to Spark)
            stored = pool.submit(store.write, batch_id, fired.store,
                                 collect=("pieces",) if isinstance(job.window, FixedWindows) else ())
            pool.shutdown(wait=False)
            t = timed("plan", t)
            outputs = []
            written = deleted = 0
            main = None
            if fired.rows is not None and not (job.upserts or forced) and OP not in fired.rows.columns \
                    and batch_id != self._replay:
                # Appended windows are counted while written: no cache of them and no count job before the write.
                # (A bound on their number for the sink's choice of write: every stored piece, and as many of
                # this batch's as its events can make. A batch Spark may be replaying counts them first, as its
                # commit may be in the table already and then writes nothing to count.)
                bound = stats.events * job.window.windows_per_event + store.manifest.rows().get("pieces", 0)
                main = Output(self.sinks.main, fired.rows, None, span="window_start", expected=bound)
                outputs.append(main)
            elif fired.rows is not None:
                kept = batch.cache(fired.rows)
                if forced and OP not in kept.columns:
                    kept = kept.withColumn(OP, F.lit("upsert"))
                extra = once("deleted", lambda: [F.count(F.when(F.col(OP) == "delete", 1)).alias("deleted")]) \
                    if OP in kept.columns else []
                span = count_span(kept, "window_start", *extra)
                deleted = span.get("deleted") or 0
                written = span["n"] - deleted
                outputs.append(Output(self.sinks.main, kept, span["n"], deleted, span["lo"], span["hi"],
                                      [*job.keys, "window_start"] if job.upserts or forced else None))
            t = timed("fire windows", t)
            tables = self.write(outputs, commit, batch_id)
            if main is not None:
                written = main.rows or 0
            keeping = list(prior)
            n_late = 0
            if lated is not None and flush:
                tables.update(lated.result())
                if may_be_late and late.rows:  # (the rows committed, less those kept by earlier batches)
                    n_late = max(0, late.rows - sum(p.rows for p in kept_late))
            elif lated is not None:
                kept_now = lated.result()
                if kept_now is not None:
                    keeping.append(kept_now)
                    n_late = kept_now.rows
            if flush:
                tables.update(quarantined.result())
                keeping = []
            else:
                keeping.extend(quarantined.result())
            t = timed("commits", t)
            new_files = stored.result()
            events = sum(f.rows for f in new_files if f.kind == "ids")
            t = timed("dedup + windows + store", t)
            stored = None
            manifest, removed = maintain(job, store, new_files, compaction.result() if compaction else Compaction(), w_out)
            stats = replace(stats, events=events, duplicates=stats.events - events, late=n_late,
                            rows_written=written, rows_deleted=deleted, watermark_out_ms=w_out)
            if flush:
                removed = [*removed, *side.folders(prior)]
                if batch_id == self._replay:  # (its own folder: a first attempt may have kept its side rows there)
                    removed.append(self.layout.side(batch_id, "").rstrip("/"))
            self.finish(batch_id, stats, previous, tables, started, store=manifest, removed=tuple(removed),
                        state_rows=manifest.rows(), pending=tuple(keeping))
            if self._forced_ranges:  # ranges no window of which can fire any more are done with
                open_after = [f.lo for f in manifest.of_kind("pieces")]
                after = job.window.final_horizon_ms(w_out, job.watermark.allowed_lateness_ms, open_after)
                if any(hi <= after for _, hi in self._forced_ranges):
                    self._forced_ranges = [r for r in self._forced_ranges if r[1] > after]
                    self.state.save_forced_ranges(self._forced_ranges)
            timed("store + record", t)
        finally:
            for strand in (quarantined, lated, stored, compaction):  # a failure elsewhere: let the others end first
                if strand is not None:
                    strand.exception()
            restore(spark, before)
            batch.release()
