"""A stream's and a backfill's tables are created (or checked) on a thread of their own while the first Spark job
runs (``io.tables.TablesPending``): nothing is committed before they exist, a creation that fails stops the run
with its own error, and a run that commits nothing still leaves its tables created."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from batch.backfill import backfill
from streaming.checkpoint.layout import Layout
from streaming.checkpoint.records import EngineState
from streaming.declaration import Agg, Table, Watermark, WindowedJob
from streaming.jobs.sources import PAYMENTS
from streaming.run.runner import run_stream
from streaming.windows import Tumbling
from tests.landing import MIN, T0, payment, write_batches


def measures(frame):
    return frame.select("user_id", "event_time", "event_id", "amount")


def job(sink: str) -> WindowedJob:
    return WindowedJob(name="pending_tables", sources=(PAYMENTS,), keys=("user_id",), window=Tumbling(timedelta(minutes=5)),
                       watermark=Watermark(timedelta(seconds=5)), transform=measures,
                       aggregates=(Agg.count("events"), Agg.sum("amount", "total")), sink=Table(sink))


@pytest.fixture
def blocked(warehouse):
    """A namespace of the warehouse whose folder cannot be made (a file is in its way): creating a table there fails."""
    path = Path(warehouse) / "blocked"
    path.write_text("in the way")
    yield "lake.blocked.windows"
    path.unlink()


def _committed_batches(checkpoint: str) -> list[str]:
    commits = Path(Layout(checkpoint).root) / "commits"
    return sorted(p.name for p in commits.iterdir() if p.name.isdigit()) if commits.exists() else []


def test_a_stream_whose_tables_cannot_be_created_stops_with_that_error_and_commits_nothing(spark, lake, blocked):
    write_batches(lake.landing_dir("payments"), [[payment("e1", T0), payment("e2", T0 + MIN)], [payment("e3", T0 + 9 * MIN)]])
    declared = job(blocked)
    with pytest.raises(Exception) as info:
        run_stream(spark, lake, declared, available_now=True, progress=None, install_signal_handlers=False)
    # the creation's own error, not the streaming query's wrapping of the batch that waited for it
    assert "Create namespace failed: blocked" in str(info.value)
    assert "StreamingQueryException" not in type(info.value).__name__
    checkpoint = lake.checkpoint_dir(declared.name)
    assert _committed_batches(checkpoint) == [], "no batch may be committed without its tables"
    assert EngineState(spark, checkpoint).latest_record() is None


def test_a_stream_that_commits_nothing_leaves_its_tables_created(spark, lake, monkeypatch):
    from streaming.io.sinks.iceberg import IcebergSink

    ensure = IcebergSink.ensure

    def slow(self, *args, **kwargs):  # (a slow catalog: the stream is over before the tables would be)
        time.sleep(2)
        return ensure(self, *args, **kwargs)

    monkeypatch.setattr(IcebergSink, "ensure", slow)
    Path(lake.landing_dir("payments")).mkdir(parents=True, exist_ok=True)  # (an empty landing folder: no batch at all)
    declared = job("lake.test.pending_windows")
    run_stream(spark, lake, declared, available_now=True, progress=None, install_signal_handlers=False)
    for table in ("lake.test.pending_windows", "lake.test.pending_windows_late", "lake.quarantine.payments"):
        assert spark.catalog.tableExists(table), table


def test_a_backfill_whose_tables_cannot_be_created_stops_with_that_error(spark, lake, blocked):
    write_batches(lake.landing_dir("payments"), [[payment("e1", T0), payment("e2", T0 + MIN)]])
    day = datetime.fromtimestamp(T0 / 1000, tz=timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    with pytest.raises(Exception, match="Create namespace failed: blocked"):
        backfill(spark, lake, job(blocked), day, day + timedelta(days=1), progress=None)
    assert not spark.catalog.tableExists("lake.quarantine.payments") or \
        spark.table("lake.quarantine.payments").where("detected_by = 'pending_tables'").count() == 0
