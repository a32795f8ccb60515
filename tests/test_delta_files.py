"""Delta tables written from the executors: a bulk write's data files are written by Spark's tasks into the
table's folder and only their descriptions reach the driver, which commits them with delta-rs; the
exactly-once markers and the range semantics are those of every other write. Checked against plain Python."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

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
