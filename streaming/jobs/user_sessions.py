"""user_sessions: per user, sessions of login and payment activity separated by 30 minutes.

Grain: one row per (user_id, window_start) session: ``window_start`` is the first event,
``window_end`` the last event plus the 30-minute gap (Flink's session window bounds). Allowed
lateness 10 minutes: a late event within it extends or merges sessions (the merged-away rows are
deleted); later ones go to ``lake.logins.user_sessions_late``.
"""

from datetime import timedelta

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from streaming.declaration import Agg, Table, Watermark, WindowedJob
from streaming.jobs.sources import LOGINS, PAYMENTS
from streaming.windows import Session


def activity(events: DataFrame) -> DataFrame:
    """Logins and payments of a user: which kind, and the amount of payments."""
    is_payment = F.col("source") == "payments"
    return events.select(
        "user_id",
        "event_time",
        "event_id",
        is_payment.cast("long").alias("payment"),
        (~is_payment).cast("long").alias("login"),
        F.when(is_payment, F.col("amount")).otherwise(F.lit(0).cast("decimal(18,2)")).alias("amount"),
    )


JOB = WindowedJob(
    name="user_sessions",
    description="Per user, sessions of logins and payments with a 30-minute inactivity gap.",
    sources=(LOGINS, PAYMENTS),
    keys=("user_id",),
    window=Session(gap=timedelta(minutes=30)),
    watermark=Watermark(out_of_orderness=timedelta(seconds=5), allowed_lateness=timedelta(minutes=10)),
    transform=activity,
    aggregates=(
        Agg.count("events"),
        Agg.sum("login", "logins"),
        Agg.sum("payment", "payments"),
        Agg.sum("amount", "payments_total"),
        Agg.max("event_time", "last_event"),
    ),
    sink=Table("lake.logins.user_sessions"),
    owner="growth",
)
