"""The bounded twin's computation, shared by backfills (which write it) and reconciliation (which
compares the stream's tables with it).

Bounded semantics (Flink's batch execution of a bounded stream): every file of the landing zone
is read (late arrivals sit in later files); nothing is late; at end of input every window and
every event-time timer fires. Windowed jobs compute the windows *starting* in ``[lo, hi)`` from
the events those windows need; keyed jobs replay ``history`` of event time before ``lo`` to
rebuild their state and keep the outputs whose time column lies in the range.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Callable, Mapping

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from streaming.declaration import Job, KeyedJob
from streaming.time import from_epoch_ms
from streaming.time import POS_INF_MS
from streaming.checkpoint.records import BatchStats
from streaming.io.parse import parse_sources
from streaming.windowed.batch import plan_batch
from streaming.io.sources import read_all
from streaming.settings import Settings


def read_landing(spark, settings: Settings, job: Job, as_of: Mapping[str, int] | None = None) -> DataFrame:
    """Every record of every source of ``job``, as a batch (see ``io.sources``); a source with a position in
    ``as_of`` (by source name, e.g. a table's snapshot) is read up to it."""
    return read_all(spark, settings, job, dict(as_of or {}))


@dataclass
class Bounded:
    """The bounded result of ``job`` over ``[lo, hi)``: lazily built frames, cached while in use. Its
    statistics are complete after an action over ``main`` (the events it keeps are counted on the way);
    the lines quarantined per source are known from the start."""

    job: Job
    lo: int
    hi: int
    main: DataFrame  # the main table's rows of the range
    consumed: DataFrame  # dedup keys (``event_id``) of the events the run read for the range
    quarantine: dict[str, DataFrame]  # per source (possibly empty: see ``quarantined``)
    _stats: Callable[[], BatchStats]
    _quarantined: Callable[[], dict[str, int]] | None = None  # lines quarantined per source, if counted
    _release: list = field(default_factory=list)

    def final_stats(self) -> BatchStats:
        """The run's statistics (call it after an action over ``main`` has run)."""
        return self._stats()

    def quarantined(self, source: str) -> int | None:
        """Lines of ``source`` quarantined (None: not counted apart)."""
        return None if self._quarantined is None else self._quarantined().get(source, 0)

    def release(self) -> None:
        for fn in self._release:
            fn()


def compute(spark, settings: Settings, job: Job, lo: int, hi: int, say=lambda _m: None,
            as_of: Mapping[str, int] | None = None) -> Bounded:
    """``as_of``: the snapshot each table source is read at (by source name; default: its current one).
    Windowed jobs: nothing runs until ``main`` is read; keyed jobs run their function here."""
    from streaming.io.validation import check_job

    check_job(spark, job)
    raw = read_landing(spark, settings, job, as_of)
    if isinstance(job, KeyedJob):
        return _keyed(spark, job, raw, lo, hi, say, time.monotonic())
    plan = plan_batch(job, raw, bounded=True, event_range_ms=job.window.events_for(lo, hi))
    plan.count()  # (the lines cached and counted first: the quarantine's write need not wait for the firing)
    rows = plan.fire(POS_INF_MS).rows
    in_range = (F.col("window_start") >= F.lit(from_epoch_ms(lo))) & (F.col("window_start") < F.lit(from_epoch_ms(hi)))
    key = job.source.dedup_key

    def stats() -> BatchStats:
        # One pass counted both: the lines (before the dedup) and the events the firing kept.
        lines, kept = plan.stats(), plan.events_seen()
        return replace(lines, events=kept, duplicates=lines.events - kept, watermark_out_ms=POS_INF_MS)

    def quarantined() -> dict[str, int]:
        plan.stats()
        return plan.quarantined_by_source

    return Bounded(
        job=job, lo=lo, hi=hi, main=rows.where(in_range),
        consumed=plan.events().select(F.col(key).cast("string").alias(key)),
        quarantine={s.name: plan.quarantine(s.name) for s in job.sources},
        _stats=stats, _quarantined=quarantined, _release=[plan.release],
    )


def _keyed(spark, job: KeyedJob, raw: DataFrame, lo: int, hi: int, say, started: float) -> Bounded:
    from streaming.spark.keyed import KeyedOutput, bounded_frame, main_schema

    parsed = parse_sources(job, raw)
    t_ms = F.unix_millis(F.col(job.source.event_time))
    first = lo - int(job.history / timedelta(milliseconds=1))
    # Cached: the function's input is the transformed events and the invalid lines, two readers of the
    # parsed lines, which would otherwise read and parse every line twice (the windowed twin caches them too).
    parsed = parsed.where(F.col("_reason").isNotNull() | ((t_ms >= first) & (t_ms < hi))).cache()
    frame = bounded_frame(job, parsed).cache()
    output = KeyedOutput(job, frame, main_schema(job))
    c = output.counts()
    seconds = time.monotonic() - started
    lines = c.inputs + c.bad
    say(f"  ran the keyed function over {c.inputs:,} events ({lines / max(seconds, 1e-9):,.0f} events/s), "
        f"{c.bad:,} quarantined")
    stats = BatchStats(lines=lines, quarantined=c.bad, events=c.inputs - c.duplicates, duplicates=c.duplicates,
                       max_event_time_ms=c.max_event_time_ms, watermark_out_ms=POS_INF_MS)
    column = F.unix_millis(F.col(job.time_column))
    key = job.source.dedup_key
    events = parsed.where(F.col("_reason").isNull() & (t_ms >= lo) & (t_ms < hi))
    return Bounded(
        job=job, lo=lo, hi=hi, main=output.main().where((column >= lo) & (column < hi)),
        consumed=events.select(F.col(key).cast("string").alias(key)),
        quarantine={s.name: output.quarantine(s.name) for s in job.sources},
        _stats=lambda: stats, _release=[frame.unpersist, parsed.unpersist],
    )
