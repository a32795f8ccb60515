"""``foreachBatch`` of a windowed job: the event-time batch (``windowed``) over the incremental store, then
its commits, exactly once per table (see ``commit``)."""

from __future__ import annotations

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
from .commit import INTERPRETED, ONE_PARTITION, Handler, Output, count_span, override, restore


class WindowedHandler(Handler):
    """``foreachBatch`` of a windowed job: the engine's batch over the incremental store, then the commits."""

    job: WindowedJob

    def __init__(self, *args, store_schemas: dict, storage_options: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.store_schemas = store_schemas
        self.storage_options = dict(storage_options or {})
        self._forced_ranges: list[tuple[int, int]] | None = None

    def _forced(self, spark) -> list[tuple[int, int]]:
        """The checkpoint's forced ranges, read once per run (a forced backfill writes them only while no stream
        holds the job's lease)."""
        if self._forced_ranges is None:
            self._forced_ranges = self.state.forced_ranges()
        return self._forced_ranges

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
            # Four strands overlap: the quarantine's commit (it reads nothing but the cached lines) starts
            # now; the late rows' commit once they are planned (before the firing: in a small batch the late
            # table's commit was the last to end); the store's write once the firing is planned; the fired
            # windows and their commit on this thread. None of them reads what another adds.
            pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix=f"batch-{job.name}")
            quarantined = pool.submit(lambda: self.write(
                [Output(self.sinks.quarantine[s], batch.quarantine(s, commit.id, batch_id), n)
                 for s, n in batch.quarantined_by_source.items()],
                commit, batch_id))
            late = None
            if batch.may_be_late():  # only a batch with events behind the watermark has late rows: counted as written
                late = Output(self.sinks.late, batch.late(), None, span="window_start",
                              expected=batch.late_candidates() * job.window.windows_per_event)
                lated = pool.submit(self.write, [late], commit, batch_id)
            fired = batch.fire(w_out)
            stored = pool.submit(store.write, batch_id, fired.store)
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
            if lated is not None:
                tables.update(lated.result())
            n_late = late.rows or 0 if late is not None else 0
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
