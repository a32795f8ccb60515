"""Delta tables written from the executors: a bulk write's data files are written by Spark's tasks into the
table's folder and only their descriptions reach the driver, which commits them with delta-rs; the
exactly-once markers and the range semantics are those of every other write. Checked against plain Python."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from pyspark.sql import types as T

from streaming.declaration import Table
from streaming.io.sinks.base import Commit
from streaming.io.sinks.delta import DeltaRsSink

DAY = datetime(2026, 11, 20, tzinfo=timezone.utc)
SCHEMA = T.StructType([T.StructField("user_id", T.StringType()), T.StructField("window_start", T.TimestampType()),
                       T.StructField("n", T.LongType())])


def ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def rows_of(sink) -> set:
    return {(r.user_id, r.window_start.replace(tzinfo=timezone.utc) if r.window_start.tzinfo is None else r.window_start, r.n)
            for r in sink.read().collect()}


def as_utc(rows) -> set:
    """Expected rows with their times in UTC, as :func:`rows_of` reads them."""
    return {(u, t.replace(tzinfo=timezone.utc) if t.tzinfo is None else t, n) for u, t, n in rows}


def frame(spark, rows):
    return spark.createDataFrame([(u, t, n) for u, t, n in rows], SCHEMA)


def data_files(sink) -> list[str]:
    from deltalake import DeltaTable

    root = sink.location().rstrip("/") + "/"
    return [u[len(root):] if u.startswith(root) else u.split(root.lstrip("/"), 1)[-1]
            for u in DeltaTable(sink.location()).file_uris()]


def test_bulk_writes_go_from_the_executors_and_a_partial_day_range_keeps_the_rest_of_its_days(spark, tmp_path):
    sink = DeltaRsSink(spark, Table("lake.test.delta_files"), str(tmp_path / "delta"))
    sink.ensure(SCHEMA, "window_start", "test table")
    hours = [DAY + timedelta(hours=h) for h in range(0, 48, 3)]  # two days, every 3 hours
    first = {(f"u{i % 3}", t, i) for i, t in enumerate(hours)}
    sink.replace_range(frame(spark, first), "window_start", ms(DAY), ms(DAY + timedelta(days=2)), {"by": "test"})
    assert rows_of(sink) == {(u, t.replace(tzinfo=None).replace(tzinfo=timezone.utc), n) for u, t, n in first}
    assert data_files(sink) and all(f.startswith("lakestream-") for f in data_files(sink)), data_files(sink)

    # [06:00, 12:00) of the first day: its rows there are replaced, the rest of that day and the next stay
    lo, hi = DAY + timedelta(hours=6), DAY + timedelta(hours=12)
    second = {("u9", DAY + timedelta(hours=7), 100), ("u9", DAY + timedelta(hours=11, minutes=59), 101)}
    sink.replace_range(frame(spark, second), "window_start", ms(lo), ms(hi), {"by": "test"})
    expected = {r for r in first if not lo <= r[1] < hi} | second
    assert rows_of(sink) == expected

    # an append of uncounted rows goes from the executors too, and a replay of its commit adds nothing
    commit = Commit("app", 7)
    third = {("u5", DAY + timedelta(hours=30), 200)}
    before = set(data_files(sink))
    assert sink.append(frame(spark, third), commit, may_exist=False, rows=None)
    added = set(data_files(sink)) - before
    assert added and all(f.startswith("lakestream-") for f in added)
    assert not sink.append(frame(spark, third), commit, may_exist=True, rows=None)
    assert rows_of(sink) == expected | third
    assert sink.is_committed(commit)

    # a small counted append is written by delta-rs from the driver, in the same table
    sink.append(frame(spark, {("u6", DAY + timedelta(hours=1), 300)}), Commit("app", 8), rows=1)
    assert rows_of(sink) == expected | third | {("u6", DAY + timedelta(hours=1), 300)}


def test_a_streams_append_after_a_backfills_overwrite_of_its_day_is_retried_and_keeps_both(spark, tmp_path):
    """A forced backfill beside a running stream: the backfill replaces a day between the moment the stream's append
    read the table and its commit. delta-rs refuses that commit ("a concurrent transaction deleted data this
    operation read", though an append reads nothing); it is a conflict to retry on the new version, not a failure
    that ends the stream (seen once in the operator's-bad-day test on Delta). Checked against plain Python."""
    location = str(tmp_path / "delta")
    backfill = DeltaRsSink(spark, Table("lake.test.delta_race"), location)
    backfill.ensure(SCHEMA, "window_start", "test table")
    old = {("u1", DAY + timedelta(hours=1), 1), ("u2", DAY + timedelta(hours=2), 2)}
    backfill.replace_range(frame(spark, old), "window_start", ms(DAY), ms(DAY + timedelta(days=1)), {"by": "test"})
    replaced = {("u1", DAY + timedelta(hours=1), 10)}
    overwrites = []

    class Stream(DeltaRsSink):
        def _write_files(self, rows, table):  # (the stream's files are written while the backfill commits)
            actions = super()._write_files(rows, table)
            if not overwrites:
                overwrites.append(table.version())
                backfill.replace_range(frame(spark, replaced), "window_start", ms(DAY), ms(DAY + timedelta(hours=12)),
                                       {"by": "backfill"})
            return actions

    stream = Stream(spark, Table("lake.test.delta_race"), location)
    commit = Commit("stream", 3)
    appended = {("u3", DAY + timedelta(hours=13), 3)}
    assert stream.append(frame(spark, appended), commit, may_exist=False, rows=None)
    assert overwrites and stream._dt().version() > overwrites[0] + 1  # (the overwrite landed between: it was retried)
    assert rows_of(stream) == as_utc(replaced | appended)
    assert stream.is_committed(commit) and not stream.append(frame(spark, appended), commit, may_exist=True, rows=None)


def test_delta_rs_commit_conflicts_are_retried_and_other_failures_are_not(tmp_path):
    """The messages delta-rs gives a merge or an append that another writer's commit overtook (made here for real:
    each writer's table read before the other commits) are conflicts; a failure of another kind is not."""
    import pyarrow as pa
    from deltalake import DeltaTable, write_deltalake

    from streaming.io.sinks.base import is_conflict

    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"d": ["2026-11-20", "2026-11-21"], "v": [1, 2]}), partition_by=["d"])
    errors = []
    for other in ({"mode": "append"}, {"mode": "overwrite", "predicate": "d = '2026-11-20'"}):  # (the other writer)
        stale = DeltaTable(uri)
        write_deltalake(uri, pa.table({"d": ["2026-11-20"], "v": [9]}), **other)
        try:
            stale.merge(pa.table({"d": ["2026-11-21"], "v": [5]}), "t.v = s.v", source_alias="s", target_alias="t") \
                .when_not_matched_insert_all().execute()
        except Exception as exc:  # noqa: BLE001 - the error under test
            errors.append(exc)
    assert len(errors) == 2 and all(is_conflict(e) for e in errors), errors
    try:
        write_deltalake(uri, pa.table({"d": ["2026-11-20"], "v": ["not a number"]}), mode="append")
    except Exception as exc:  # noqa: BLE001
        assert not is_conflict(exc), exc
    else:
        raise AssertionError("a write of the wrong type was accepted")


def test_a_backfill_of_part_of_a_day_overtaken_by_another_replacing_that_day_fails_instead_of_losing_its_rows(spark, tmp_path):
    """Two backfills of the two halves of one day: each carries the rest of the day over as it read it. The second to
    commit would put back the first's half as it was before, so its conflict is not retried: it fails with nothing
    committed, and run again it keeps both halves (plain Python decides)."""
    from streaming.errors import SinkCommitError

    location = str(tmp_path / "delta")
    morning = DeltaRsSink(spark, Table("lake.test.delta_halves"), location)
    morning.ensure(SCHEMA, "window_start", "test table")
    before = {("u1", DAY + timedelta(hours=3), 1), ("u2", DAY + timedelta(hours=15), 2)}
    morning.replace_range(frame(spark, before), "window_start", ms(DAY), ms(DAY + timedelta(days=1)), {"by": "test"})
    noon = DAY + timedelta(hours=12)
    new_morning = {("u1", DAY + timedelta(hours=3), 10)}
    new_afternoon = {("u2", DAY + timedelta(hours=15), 20)}
    raced = []

    class Afternoon(DeltaRsSink):
        def _write_files(self, rows, table):
            actions = super()._write_files(rows, table)
            if not raced:
                raced.append(True)
                morning.replace_range(frame(spark, new_morning), "window_start", ms(DAY), ms(noon), {"by": "morning"})
            return actions

    afternoon = Afternoon(spark, Table("lake.test.delta_halves"), location)
    with pytest.raises(SinkCommitError, match="another writer replaced rows"):
        afternoon.replace_range(frame(spark, new_afternoon), "window_start", ms(noon), ms(DAY + timedelta(days=1)),
                                {"by": "afternoon"})
    assert rows_of(morning) == as_utc(new_morning | {r for r in before if r[1] >= noon})
    afternoon.replace_range(frame(spark, new_afternoon), "window_start", ms(noon), ms(DAY + timedelta(days=1)),
                            {"by": "afternoon"})
    assert rows_of(morning) == as_utc(new_morning | new_afternoon)
