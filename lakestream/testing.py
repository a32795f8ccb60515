"""A test harness for job authors: run a job over your own records, as a stream and as its bounded twin.

    from lakestream.testing import JobHarness

    def test_averages(tmp_path):
        harness = JobHarness(JOB, tmp_path)
        out = harness.stream([
            ["r-1,d-1,2026-11-20T10:00:01Z,21.5", "r-2,d-1,2026-11-20T10:00:07Z,22.0"],  # micro-batch 1
            ["r-3,d-1,2026-11-20T10:09:00Z,23.0"],                                          # micro-batch 2
        ])
        assert out.main.loc[0, "readings"] == 2     # pandas frames
        assert out.late.empty and out.quarantine.empty
        twin = harness.bounded()                      # the same job over the same records, bounded
        assert harness.reconcile().unexplained == 0   # stream and twin agree

Each micro-batch is written as one file per source into a landing folder of the harness's own lake
(under ``home``) and streamed by lakestream's real engine: a local SparkSession, real Iceberg (or
Delta) tables, the job's checkpoint. A batch is a list of records for a job with one source, or a
dict ``{source name: records}``. Records are text lines for JSON and CSV sources (for CSV, without
the header: the harness writes it when the source declares one), and dicts (or a pandas DataFrame)
for Parquet sources and table sources (a batch is one append to the table: a snapshot; the table is
created with the declared types unless it exists). ``out.watermarks`` holds the watermark after each micro-batch, ``out.batches`` each batch's counts.

One SparkSession serves every harness of a process (a JVM starts in seconds, not milliseconds):
the first harness starts it with its own warehouse; later ones reuse it and drop the tables of
their job first. ``stream()`` may be called again to continue the same stream with more batches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

import pandas as pd

from streaming.declaration import Job, Source
from streaming.io.sources import kind_of
from streaming.settings import Settings

Batch = Sequence[Any] | Mapping[str, Sequence[Any]]
_WIDE = (datetime(2000, 1, 1, tzinfo=timezone.utc), datetime(2100, 1, 1, tzinfo=timezone.utc))


@dataclass
class Result:
    """What a run wrote: the job's main rows, its late side output and the quarantined records (pandas)."""

    main: pd.DataFrame
    late: pd.DataFrame
    quarantine: pd.DataFrame
    watermarks: list[datetime | None] = field(default_factory=list)  # after each micro-batch (stream only)
    batches: list = field(default_factory=list)  # each micro-batch's BatchStats (stream only)


class JobHarness:
    """Run ``job`` over records given in arrival order, in a lake of its own under ``home``."""

    def __init__(self, job: Job, home: str | Path, *, format: str | None = None, spark=None,
                 settings: Settings | None = None, fresh_inputs: bool = True):
        """``fresh_inputs=False`` keeps the tables of table sources (e.g. written by an upstream job's
        harness in the same lake); by default they are dropped with the job's own tables."""
        from streaming.spark.session import get_spark

        home = Path(home)
        base = settings or Settings.load({"LAKESTREAM_HOME": str(home / "lake")})
        if format:
            base = replace(base, format=format)
        existing = _active_warehouse()
        if existing:  # the process's one SparkSession has its catalog's warehouse already
            base = replace(base, warehouse=existing)
        self.settings = replace(base, shuffle_partitions=2, project=None)
        self.job = job
        self.spark = spark or get_spark(self.settings)
        self._files = 0
        self._mtime = 0.0
        self._drop_tables(fresh_inputs)

    # -- input ----------------------------------------------------------------------------------
    def write(self, batch: Batch, empty_file: bool = False) -> list[Path]:
        """Write one batch of records into the landing folders (one file per source); returns the files."""
        per_source = self._by_source(batch)
        self._files += 1
        written = []
        for source in self.job.sources:
            # Spark reads files in modification-time order: a second apart, the batches keep their order.
            mtime = max(time.time(), self._mtime + 1.0)
            landed = kind_of(source).land(self.spark, self.settings, source, per_source.get(source.name),
                                          f"batch-{self._files:05d}", empty=empty_file, mtime=mtime)
            if landed:
                self._mtime = mtime
            written += landed
        return written

    def append(self, source: Source, records: Any) -> None:
        """Append records (dicts or a pandas DataFrame) to a table source's table as one snapshot. The table
        is created with the declared types if missing; create it yourself with looser types (e.g. strings)
        to feed values that break the declaration."""
        kind_of(source).land(self.spark, self.settings, source, records, f"batch-{self._files:05d}")

    def _by_source(self, batch: Batch) -> dict[str, Any]:
        names = [s.name for s in self.job.sources]
        if isinstance(batch, Mapping):
            unknown = set(batch) - set(names)
            if unknown:
                raise ValueError(f"batch names unknown source(s) {sorted(unknown)}; {self.job.name} reads {names}")
            return dict(batch)
        if len(names) > 1:
            raise ValueError(f"{self.job.name} reads {names}: give each batch as a dict {{source name: records}}")
        return {names[0]: batch}

    # -- runs -----------------------------------------------------------------------------------
    def stream(self, batches: Sequence[Batch]) -> Result:
        """Stream ``batches``, each as one micro-batch, and return the tables' contents afterwards."""
        from streaming.run.runner import run_stream

        done: list = []
        if len(self.job.sources) == 1 and kind_of(self.job.sources[0]).one_delivery_per_trigger:
            # One file per batch, read one file per trigger: one streaming query for all the batches.
            for batch in batches:
                self.write(batch, empty_file=True)
            settings = self.settings.with_job(self.job.name, max_files_per_trigger=1)
            run_stream(self.spark, settings, self.job, available_now=True, progress=done.append,
                       install_signal_handlers=False)
        else:  # a file (table: a snapshot) per source and batch: a run per batch keeps the batches apart
            for batch in batches:
                self.write(batch)
                run_stream(self.spark, self.settings, self.job, available_now=True, progress=done.append,
                           install_signal_handlers=False)
        result = self.tables()
        done = [b for b in done if not b.outside_batch]  # (a commit of kept side rows at the stop is not a batch)
        result.watermarks = [_as_datetime(b.stats.watermark_out_ms) for b in done]
        result.batches = [b.stats for b in done]
        return result

    def tables(self) -> Result:
        """The current contents of the job's tables."""
        from streaming.io.tables import job_sinks

        sinks = job_sinks(self.spark, self.settings, self.job)
        quarantine = [s.read() for s in sinks.quarantine.values()]
        bad = quarantine[0]
        for frame in quarantine[1:]:
            bad = bad.unionByName(frame, allowMissingColumns=True)
        return Result(main=_pandas(sinks.main.read()), late=_pandas(sinks.late.read()), quarantine=_pandas(bad))

    def bounded(self, start: datetime | None = None, end: datetime | None = None) -> Result:
        """The bounded twin over the same landing files (default: every record), not written anywhere."""
        from batch.bounded import compute

        from streaming.time import epoch_ms
        from streaming.io.tables import job_sinks

        lo, hi = (start or _WIDE[0]), (end or _WIDE[1])
        result = compute(self.spark, self.settings, self.job, epoch_ms(lo), epoch_ms(hi))
        try:
            quarantine = list(result.quarantine.values())
            if not quarantine:  # nothing quarantined: the quarantine tables' columns, no rows
                quarantine = [s.read().limit(0) for s in job_sinks(self.spark, self.settings, self.job).quarantine.values()]
            bad = quarantine[0]
            for frame in quarantine[1:]:
                bad = bad.unionByName(frame, allowMissingColumns=True)
            main = _pandas(result.main)
            return Result(main=main, late=main.iloc[0:0], quarantine=_pandas(bad))
        finally:
            result.release()

    def reconcile(self, start: datetime | None = None, end: datetime | None = None):
        """Compare what the stream wrote with the bounded twin (``.unexplained`` must be 0; see ``.table()``)."""
        from batch.reconcile import reconcile

        return reconcile(self.spark, self.settings, self.job, start or _WIDE[0], end or _WIDE[1], progress=None,
                         record=False)

    def _drop_tables(self, inputs: bool) -> None:
        from streaming.io.tables import all_tables, quarantine_tables

        if self.settings.format != "iceberg":
            return  # Delta tables live under the harness's own home: a new home is a new lake
        for table in [*all_tables(self.job), *quarantine_tables(self.job.sources)]:
            self.spark.sql(f"DROP TABLE IF EXISTS {table.name} PURGE")
        for source in self.job.sources if inputs else ():  # the harness's own upstream tables start empty too
            kind_of(source).reset(self.spark, source)


def _active_warehouse() -> str | None:
    from streaming.spark import session

    live = session.active_session()
    if live is None:
        return None
    return live.conf.get("spark.sql.catalog.lake.warehouse", None)


def _as_datetime(ms: int | None) -> datetime | None:
    from streaming.time import as_datetime

    return as_datetime(ms)


def _pandas(frame) -> pd.DataFrame:
    table = frame.toPandas()
    return table.reset_index(drop=True)


__all__ = ["JobHarness", "Result"]
