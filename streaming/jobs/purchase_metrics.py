"""purchase_metrics: per user, 5-minute tumbling event-time windows of payment activity.

Grain: one row per (user_id, window_start). Watermark: 5 s bounded out-of-orderness (override
with ``jobs.purchase_metrics.out_of_orderness``). Duplicate deliveries are removed by
``event_id``; late events go to ``lake.payments.purchase_metrics_late``, invalid lines to
``lake.quarantine.payments``.
"""

from datetime import timedelta

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from streaming.declaration import Agg, Table, Watermark, WindowedJob
from streaming.windows import Tumbling
from streaming.jobs.sources import PAYMENTS


def measures(payments: DataFrame) -> DataFrame:
    """One row per payment: the key, the event time, the dedup key and the measures to sum."""
    return payments.select(
        "user_id",
        "event_time",
        "event_id",
        (F.col("status") == "APPROVED").cast("long").alias("approved"),
        (F.col("status") == "DECLINED").cast("long").alias("declined"),
        "amount",
    )


JOB = WindowedJob(
    name="purchase_metrics",
    description="Per user and 5-minute event-time window: payments, approved, declined, amount.",
    sources=(PAYMENTS,),
    keys=("user_id",),
    window=Tumbling(size=timedelta(minutes=5)),
    watermark=Watermark(out_of_orderness=timedelta(seconds=5)),
    transform=measures,
    aggregates=(
        Agg.count("event_count"),
        Agg.sum("approved", "approved_count"),
        Agg.sum("declined", "declined_count"),
        Agg.sum("amount", "amount_sum"),
    ),
    sink=Table("lake.payments.purchase_metrics"),
)
