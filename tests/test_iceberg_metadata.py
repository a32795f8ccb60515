"""An Iceberg table keeps a bounded number of metadata files, however many commits a stream makes.

Every commit writes a new metadata file with the whole snapshot list; Iceberg keeps every earlier one
unless told otherwise. The files on disk are the oracle, counted in the table's folder, not asked of
Iceberg."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import types as T

from streaming.declaration import Table
from tests.conftest import scratch_namespace
from streaming.io.sinks import IcebergSink
from streaming.io.sinks.iceberg import METADATA_RETENTION

SCHEMA = T.StructType([T.StructField("n", T.IntegerType())])
KEPT = int(METADATA_RETENTION["write.metadata.previous-versions-max"])


@pytest.fixture
def namespace(spark):
    yield from scratch_namespace(spark, "metadata_test")


def _metadata_files(spark, name: str) -> list[Path]:
    location = next(r.data_type for r in spark.sql(f"DESCRIBE TABLE EXTENDED {name}").collect()
                    if r.col_name == "Location")
    folder = Path(location.removeprefix("file:")) / "metadata"
    return sorted(folder.glob("*.metadata.json"))


def _append(spark, name: str, values) -> None:
    for n in values:
        spark.createDataFrame([(n,)], SCHEMA).writeTo(name).append()


def _values(spark, name: str) -> list[int]:
    return sorted(r.n for r in spark.table(name).collect())


def test_a_table_lakestream_creates_keeps_the_last_metadata_files(spark, namespace):
    name = f"{namespace}.created"
    IcebergSink(spark, Table(name)).ensure(SCHEMA, None)
    commits = KEPT + 10
    _append(spark, name, range(commits))
    assert len(_metadata_files(spark, name)) == KEPT + 1  # the current one and the last KEPT before it
    assert _values(spark, name) == list(range(commits))  # every commit's rows still there
    assert spark.sql(f"SELECT count(*) FROM {name}.snapshots").first()[0] == commits  # snapshots untouched


def test_an_older_table_gets_the_retention_and_a_table_that_chose_otherwise_keeps_its_choice(spark, namespace):
    older = f"{namespace}.older"
    spark.sql(f"CREATE TABLE {older} (n int) USING iceberg")
    _append(spark, older, range(KEPT + 5))
    before = len(_metadata_files(spark, older))
    assert before == KEPT + 6  # (Iceberg's default: every metadata file kept)
    IcebergSink(spark, Table(older)).ensure(SCHEMA, None)
    _append(spark, older, [100])
    assert len(_metadata_files(spark, older)) == KEPT + 1
    assert _values(spark, older) == [*range(KEPT + 5), 100]

    chosen = f"{namespace}.chosen"
    spark.sql(f"CREATE TABLE {chosen} (n int) USING iceberg "
              "TBLPROPERTIES ('write.metadata.delete-after-commit.enabled'='false')")
    IcebergSink(spark, Table(chosen)).ensure(SCHEMA, None)
    _append(spark, chosen, range(KEPT + 5))
    assert len(_metadata_files(spark, chosen)) == KEPT + 6
