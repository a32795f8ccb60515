"""A declaration Spark cannot run is refused with one line when the job is loaded, before any
stream starts or any table or checkpoint is created."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from pyspark.sql import functions as F

from batch.backfill import backfill
from streaming.declaration import Agg, Table, Watermark, WindowedJob
from streaming.errors import DeclarationError
from streaming.run.runner import run_stream
from streaming.jobs.sources import PAYMENTS
from streaming.windows import Tumbling
from tests.landing import T0, payment, write_batches

SINK = "lake.test.declared"


def measures(frame):
    return frame.select("user_id", "event_time", "event_id", "amount", (F.col("status") == "DECLINED").alias("declined"))


def job(aggregates=(Agg.count("events"), Agg.sum("amount", "total")), having=None, transform=measures) -> WindowedJob:
    return WindowedJob(name="declared_test", sources=(PAYMENTS,), keys=("user_id",), window=Tumbling(timedelta(minutes=5)),
                       watermark=Watermark(timedelta(seconds=5)), transform=transform, aggregates=aggregates,
                       sink=Table(SINK), having=having)


def refused(spark, lake, declared) -> str:
    write_batches(lake.landing_dir("payments"), [[payment("e1", T0)]])
    with pytest.raises(DeclarationError) as info:
        run_stream(spark, lake, declared, available_now=True, progress=None, install_signal_handlers=False)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    assert not Path(lake.checkpoint_dir(declared.name)).exists(), "no stream may have started"
    assert not spark.catalog.tableExists(SINK), "no table may have been created"
    return message


def test_an_aggregate_over_a_column_the_transform_lacks_names_job_column_and_columns(spark, lake):
    message = refused(spark, lake, job(aggregates=(Agg.count("events"), Agg.sum("amout", "total"))))
    assert "job declared_test" in message and "'amout'" in message
    assert "user_id, event_time, event_id, amount, declined" in message  # what the transform does produce


def test_a_sum_over_text_is_refused(spark, lake):
    message = refused(spark, lake, job(aggregates=(Agg.sum("user_id", "users"),)))
    assert "sums column 'user_id' of type string" in message


@pytest.mark.parametrize("having, phrase", [
    ("declned > 5", "declned"),            # a typo in an aggregate's name
    ("events >", "not a valid predicate"),  # not SQL
    ("events + 1", "not a condition"),      # a number, not a predicate
])
def test_a_bad_having_is_refused_before_spark_plans_a_batch(spark, lake, having, phrase):
    message = refused(spark, lake, job(having=having))
    assert f"having {having!r}" in message and phrase in message
    assert "user_id, window_start, window_end, events, total" in message or "not a condition" in message


def test_a_transform_that_reads_a_missing_field_is_refused(spark, lake):
    message = refused(spark, lake, job(transform=lambda f: f.select("user_id", "event_time", "event_id", "amonut")))
    assert "its transform fails on the fields of payments" in message and "amonut" in message


def test_the_bounded_twin_refuses_the_same_declaration(spark, lake):
    write_batches(lake.landing_dir("payments"), [[payment("e1", T0)]])
    with pytest.raises(DeclarationError, match="'amout'"):
        backfill(spark, lake, job(aggregates=(Agg.sum("amout", "total"),)), *(_day()), progress=None)
    assert not spark.catalog.tableExists(SINK)


def _day():
    from streaming.time import from_epoch_ms

    start = from_epoch_ms(T0 - T0 % 86_400_000)
    return start, start + timedelta(days=1)
