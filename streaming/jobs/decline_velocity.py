"""decline_velocity: users with more than 5 declined payments in any 10 minutes of event time.

Grain: one row per (user_id, window_start) of a 10-minute window sliding every minute that holds
more than 5 declined payments. Allowed lateness 2 minutes: a late decline within it corrects (or
creates) the alert; later ones go to ``lake.fraud.decline_alerts_late``.
"""

from datetime import timedelta

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from streaming.declaration import Agg, Table, Watermark, WindowedJob
from streaming.jobs.sources import PAYMENTS
from streaming.windows import Sliding


def declines(payments: DataFrame) -> DataFrame:
    """Declined payments only: the key, the event time and the dedup key."""
    return payments.where(F.col("status") == "DECLINED").select("user_id", "event_time", "event_id")


JOB = WindowedJob(
    name="decline_velocity",
    description="Users with more than 5 declined payments in a 10-minute event-time window (sliding by 1 minute).",
    sources=(PAYMENTS,),
    keys=("user_id",),
    window=Sliding(size=timedelta(minutes=10), every=timedelta(minutes=1)),
    watermark=Watermark(out_of_orderness=timedelta(seconds=5), allowed_lateness=timedelta(minutes=2)),
    transform=declines,
    aggregates=(
        Agg.count("declined"),
        Agg.min("event_time", "first_decline"),
        Agg.max("event_time", "last_decline"),
    ),
    having="declined > 5",
    sink=Table("lake.fraud.decline_alerts"),
    owner="fraud",
)
