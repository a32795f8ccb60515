"""``foreachBatch`` of a keyed job: the keyed binding's typed output of the batch, committed exactly once
per table (see ``commit``)."""

from __future__ import annotations

import time

from pyspark import StorageLevel
from pyspark.sql import DataFrame

from ..checkpoint.records import KEY_DELTAS_FORMAT, BatchStats, watermark_of
from ..declaration import KeyedJob
from ..time import advance
from ..windowed.batch import INTERPRETED_BATCH_LINES, SMALL_BATCH_LINES
from .commit import ONE_PARTITION, Handler, Output, override, restore

# Spark generates the code of the keyed query's stages (the lines' parse, the transform, the input's projections)
# for every batch, on the stream's thread before the batch starts: ~50 ms of each ~0.75 s batch under a feed of
# 5k payments/s. A batch after a small one (at most ``INTERPRETED_BATCH_LINES`` lines) runs them interpreted; a
# batch after a large one, and a run's first batch, compiled.
NEXT_INTERPRETED = {"spark.sql.codegen.wholeStage": "false"}


class KeyedHandler(Handler):
    """``foreachBatch`` of a keyed job: the runtime's output rows split by kind and committed."""

    job: KeyedJob

    def __init__(self, *args, main_schema, key_buckets: int, bucket_labels: tuple[int, ...] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.main_schema = main_schema
        self.key_buckets = key_buckets
        self.bucket_labels = bucket_labels
        self._compiled: dict[str, str | None] | None = None  # the settings NEXT_INTERPRETED replaced, while it is set

    def __call__(self, frame: DataFrame, batch_id: int) -> None:
        from ..spark.keyed import KeyedOutput

        spark = frame.sparkSession
        started = t = time.perf_counter()
        timed = self.report.timed
        self.begin(spark, batch_id)
        job = self.job
        previous = self.previous(batch_id)
        before: dict[str, str | None] = {}
        frame = frame.persist(StorageLevel.MEMORY_AND_DISK)
        try:
            output = KeyedOutput(job, frame, self.main_schema)
            c = output.counts()
            t = timed("state function", t)
            self._plan_next(spark, interpreted=c.inputs + c.bad <= INTERPRETED_BATCH_LINES)
            if c.inputs + c.bad <= SMALL_BATCH_LINES:
                # The state function's plan is fixed (Spark planned it with the checkpoint's partitions); what
                # follows splits a small output by table and shuffles it for each table's layout: one partition.
                override(spark, ONE_PARTITION, before)
            watermark_in = watermark_of(previous) if c.watermark_ms is None else c.watermark_ms
            watermark_out = advance(watermark_in, c.max_event_time_ms, job.watermark.out_of_orderness_ms)
            # (a table without rows gets no commit: its frame is not even built)
            commit = self.commit(batch_id, watermark_out)
            outputs = [Output(self.sinks.quarantine[s], output.quarantine(s, commit.id, batch_id) if n else None, n)
                       for s, n in c.quarantined.items()]
            outputs.append(Output(self.sinks.late, output.late(watermark_in) if c.late else None, c.late, 0,
                                  *c.late_range_ms))
            outputs.append(Output(self.sinks.main, output.main() if c.outputs else None, c.outputs, 0,
                                  *c.outputs_range_ms))
            tables = self.write(outputs, commit, batch_id)
            t = timed("commits", t)
            stats = BatchStats(
                lines=c.inputs + c.bad, quarantined=c.bad, events=c.inputs - c.duplicates, duplicates=c.duplicates,
                late=c.late, rows_written=c.outputs, max_event_time_ms=c.max_event_time_ms,
                watermark_in_ms=watermark_in, watermark_out_ms=watermark_out,
            )
            self.finish(batch_id, stats, previous, tables, started, key_buckets=self.key_buckets,
                        bucket_labels=self.bucket_labels, removed=c.dropped, format=KEY_DELTAS_FORMAT)
            timed("save record", t)
        finally:
            restore(spark, before)
            frame.unpersist()

    def _plan_next(self, spark, *, interpreted: bool) -> None:
        """How the next batch's stages run (see :data:`NEXT_INTERPRETED`): the stream's own session (Spark plans each
        batch with it), set until a large batch sets it back."""
        if interpreted and self._compiled is None:
            self._compiled = {}
            override(spark, NEXT_INTERPRETED, self._compiled)
        elif not interpreted and self._compiled is not None:
            restore(spark, self._compiled)
            self._compiled = None
