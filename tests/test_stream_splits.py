"""How a stream's batch of landing files is cut into tasks (``session.STREAM_READ_CONF``): one split per core
for a batch of small files, whatever their number, and even halves of one large file."""

import pytest
from pyspark.sql import functions as F

from streaming.settings import Settings
from streaming.spark.session import stream_session


def _line(i: int) -> str:
    return f'{{"event_id": "e{i:09d}", "filler": "{"x" * 150}"}}\n'  # ~190 bytes, a payment's size


def _write(folder, files: int, lines: int) -> None:
    folder.mkdir(parents=True)
    n = 0
    for f in range(files):
        with open(folder / f"part-{f:03d}.json", "w") as out:
            for _ in range(lines):
                out.write(_line(n))
                n += 1


def _streams(spark):
    """The stream's session, planning splits for 2 cores (this machine's, and CI's) wherever the test runs."""
    streams = stream_session(spark, Settings.load())
    assert streams is not spark, "a stream's session is a copy (its settings must not reach the shared session)"
    streams.conf.set("spark.sql.leafNodeDefaultParallelism", "2")
    return streams


def _lines_per_split(session, folder) -> list[int]:
    frame = session.read.text(str(folder)).select(F.spark_partition_id().alias("p"))
    return [r["count"] for r in frame.groupBy("p").count().collect()]


@pytest.mark.parametrize("files", [3, 5, 7, 9])
def test_a_batch_of_small_files_is_one_split_per_core(spark, tmp_path, files):
    """A 5k events/s feed writes a ~95 KB file every 0.1 s. With the opening cost below a file's size, Spark
    packed an odd number of them into one split more than there are cores (7 files: 3 + 3 + 1), a second
    wave of tasks in every such batch."""
    folder = tmp_path / "landing"
    _write(folder, files, 500)
    splits = _lines_per_split(_streams(spark), folder)
    assert sum(splits) == files * 500
    assert len(splits) == 2, splits


def test_one_large_file_is_read_in_even_parts(spark, tmp_path):
    folder = tmp_path / "landing"
    _write(folder, 1, 46_000)  # ~8.8 MB: one file per trigger of 50k-line batches
    splits = _lines_per_split(_streams(spark), folder)
    assert sum(splits) == 46_000 and len(splits) == 2
    assert max(splits) <= 1.05 * min(splits), splits
