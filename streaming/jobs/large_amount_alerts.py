"""large_amount_alerts: a card payment more than 10x the card's previous payment (within 24 h).

Grain: one row per alerting payment. Keyed value state: the card's previous amount, kept 24 h of
event time (TTL), so a card quiet for a day starts afresh and idle cards leave no state behind.
"""

from datetime import timedelta

from pyspark.sql import DataFrame

from streaming.declaration import KeyedJob, Table, Watermark
from streaming.keyed import KeyedProcessFunction, RuntimeContext, TtlConfig, ValueStateDescriptor
from streaming.jobs.sources import PAYMENTS

RATIO = 10


class LargeAmount(KeyedProcessFunction):
    def open(self, ctx: RuntimeContext) -> None:
        self.previous = ctx.get_state(
            ValueStateDescriptor("previous", "struct<amount:decimal(18,2),event_time:timestamp,event_id:string>",
                                 ttl=TtlConfig(timedelta(hours=24)))
        )

    def process_element(self, payment, ctx):
        before = self.previous.value()
        if before is not None and payment.amount > RATIO * before[0]:
            yield {
                "card_id": payment.card_id, "user_id": payment.user_id, "event_id": payment.event_id,
                "event_time": payment.event_time, "amount": payment.amount, "previous_amount": before[0],
                "previous_time": before[1], "previous_event_id": before[2],
                "ratio": float(payment.amount / before[0]),
            }
        self.previous.update((payment.amount, payment.event_time, payment.event_id))


def payments(frame: DataFrame) -> DataFrame:
    return frame.select("card_id", "user_id", "event_id", "event_time", "amount")


JOB = KeyedJob(
    name="large_amount_alerts",
    description="Card payments more than 10x the card's previous payment of the last 24 hours.",
    sources=(PAYMENTS,),
    keys=("card_id",),
    watermark=Watermark(out_of_orderness=timedelta(seconds=5)),
    transform=payments,
    function=LargeAmount,
    output="card_id string, user_id string, event_id string, event_time timestamp, amount decimal(18,2), "
           "previous_amount decimal(18,2), previous_time timestamp, previous_event_id string, ratio double",
    time_column="event_time",
    sink=Table("lake.fraud.large_amount_alerts"),
    history=timedelta(hours=24),
    owner="fraud",
)
