"""A stream expires the snapshots of the tables only it writes; a savepoint's snapshots stay restorable.

Every Iceberg commit adds a snapshot, and the table's metadata file carries all of them: without expiry a stream
that commits every second adds ~1 KB to each later commit, for ever (docs/design-snapshot-expiry.md). The oracles:
the snapshots counted in the table's own metadata tables, and the rows against a plain-Python replay of the input.
"""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import timedelta

import pytest

from streaming.declaration import Table
from tests.conftest import scratch_namespace
from streaming.io.sinks import IcebergSink, sink_for
from streaming.io.tables import all_tables
from streaming.checkpoint.savepoints import Savepoints
from streaming.project import get_job
from streaming.run.runner import run_stream
from tests import oracle
from tests.test_iceberg_metadata import SCHEMA, _append
from tests.test_purchase_metrics import table_windows
from tests.test_savepoints import JOB, K, _arrive, _run, _staged

MAIN, LATE, QUARANTINE = "lake.payments.purchase_metrics", "lake.payments.purchase_metrics_late", "lake.quarantine.payments"


@pytest.fixture
def namespace(spark):
    yield from scratch_namespace(spark, "expiry_test")


def _snapshots(spark, name: str) -> list[int]:
    return [r.snapshot_id for r in spark.sql(f"SELECT snapshot_id FROM {name}.snapshots ORDER BY committed_at").collect()]


def test_expiry_keeps_the_current_the_tagged_and_the_young_snapshots_and_every_row(spark, namespace):
    name = f"{namespace}.t"
    sink = IcebergSink(spark, Table(name))
    sink.ensure(SCHEMA, None)
    _append(spark, name, range(6))
    made = _snapshots(spark, name)
    assert len(made) == 6
    assert sink.tag(made[1], "keep-me")
    assert not sink.tag(123, "no-such-snapshot")  # a version the table never had is said so, not tagged

    assert sink.expire(retention_ms=3_600_000) == (6, 6)  # all younger than an hour: nothing goes
    time.sleep(0.05)
    assert sink.expire(retention_ms=1) == (6, 2)  # the current one (min-snapshots-to-keep) and the tagged one
    assert _snapshots(spark, name) == [made[1], made[5]]
    assert sorted(r.n for r in spark.table(name).collect()) == list(range(6))  # appends: every row stays
    assert sorted(r.n for r in spark.read.option("snapshot-id", made[1]).table(name).collect()) == [0, 1]

    sink.untag("keep-me")
    assert sink.expire(retention_ms=1) == (2, 1)
    assert _snapshots(spark, name) == [made[5]]


def test_a_table_that_sets_its_own_retention_keeps_it(spark, namespace):
    name = f"{namespace}.own"
    sink = IcebergSink(spark, Table(name))
    sink.ensure(SCHEMA, None)
    spark.sql(f"ALTER TABLE {name} SET TBLPROPERTIES ('history.expire.max-snapshot-age-ms'='3600000')")
    _append(spark, name, range(4))
    time.sleep(0.05)
    assert sink.expire(retention_ms=1) == (4, 4)  # the table's hour wins over the stream's default


def test_a_stream_expires_its_own_tables_and_a_savepoint_still_restores_them(spark, lake, tmp_path):
    """Expiry after every batch with a retention of a millisecond: the job's main and late tables keep their current
    snapshot and the savepoint's; the shared quarantine table keeps all; a restore then resumes to exactly the
    tables of an uninterrupted run."""
    iceberg = replace(lake.iceberg, snapshot_retention=timedelta(milliseconds=1), expire_every=timedelta(0))
    # (side tables committed with every batch: an empty late output is committed too, so both tables have a
    # snapshot at the savepoint)
    settings = replace(lake, iceberg=iceberg).with_job(JOB, max_files_per_trigger=K, side_outputs_every=timedelta(0))
    landing, files = _staged(settings, tmp_path)
    _arrive(files[: 2 * K], landing)
    _run(spark, settings)
    savepoints = Savepoints(spark, settings, progress=None)
    sp = savepoints.create(get_job(JOB, settings))
    assert sp.manifest["tags"] == {MAIN: f"lakestream-savepoint-{sp.id}", LATE: f"lakestream-savepoint-{sp.id}"}
    kept = {name: sp.manifest["tables"][name] for name in (MAIN, LATE)}
    quarantine_before = len(_snapshots(spark, QUARANTINE))

    _arrive(files[2 * K :], landing)  # more batches, each starting with an expiry
    seen = {name: set() for name in kept}  # every snapshot the tables had after each batch

    def look(_result):
        for name in kept:
            seen[name].update(_snapshots(spark, name))

    report = run_stream(spark, settings, get_job(JOB, settings), available_now=True, progress=look,
                        install_signal_handlers=False)
    assert report.batches >= 3
    for name, version in kept.items():
        left = set(_snapshots(spark, name))
        assert version in left  # the savepoint's, tagged
        # The current one at the last batch's start and that batch's own are all that may stay besides.
        assert len(left - {version}) <= 2, (name, left)
    assert seen[LATE] - set(_snapshots(spark, LATE))  # the late table's earlier snapshots of the run went
    assert len(_snapshots(spark, QUARANTINE)) > quarantine_before  # shared: a stream never expires it

    savepoints.restore(get_job(JOB, settings), sp.id)
    for name, version in kept.items():
        assert sink_for(spark, settings, Table(name), JOB).version() == version
    _run(spark, settings)

    all_files = oracle.files_in_arrival_order(landing)
    batches = [[line for p in all_files[i : i + K] for line in oracle.read_lines(p)] for i in range(0, len(all_files), K)]
    truth = oracle.replay_stream(batches)
    read = {t.name: sink_for(spark, settings, t, JOB).read() for t in all_tables(get_job(JOB))}
    read[MAIN].createOrReplaceTempView("expired_windows")
    assert table_windows(spark, "expired_windows") == truth.closed  # also fails on a duplicate window
    assert sorted(r.event_id for r in read[LATE].collect()) == sorted(truth.late_ids)
    assert read[QUARANTINE].agg({"occurrences": "sum"}).first()[0] == truth.invalid_lines

    savepoints.delete(sp.id)  # its tags go with it: the next expiry may take those snapshots
    for name in kept:
        tags = [r.name for r in spark.sql(f"SELECT name FROM {name}.refs WHERE type = 'TAG'").collect()]
        assert tags == []
