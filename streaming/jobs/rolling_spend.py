"""rolling_spend: per card, approved spend over the last 24 hours of event time, on every change.

Grain: one row per change of a card's 24-hour spend: a payment enters (``cause = payment``) or an
earlier one leaves the window (``cause = expiry``, at exactly 24 h after it, by an event-time
timer). The window at time ``x`` holds the payments with ``x - 24h < event_time <= x``. State: the
card's 24-hour total, and what the payments of each event time of the last 24 hours add to it.
"""

from datetime import timedelta
from decimal import Decimal

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from streaming.declaration import KeyedJob, Table, Watermark
from streaming.keyed import KeyedProcessFunction, MapStateDescriptor, RuntimeContext, ValueStateDescriptor
from streaming.jobs.sources import PAYMENTS

DAY = timedelta(hours=24)
DAY_MS = 86_400_000
_NONE = (Decimal("0"), 0)


class RollingSpend(KeyedProcessFunction):
    """The card's total of the last 24 hours and, per event time, what its payments add: a payment adds to
    both and sets a timer 24 h later, when its time's share leaves the total. Constant work per payment and
    timer, however many payments the 24 hours hold. (Elements reach the function in event-time order, timers
    before later elements and after those of their own time.)"""

    def open(self, ctx: RuntimeContext) -> None:
        self.at = ctx.get_state(MapStateDescriptor("at", "struct<amount:decimal(18,2),n:long>", key_type="long"))
        self.total = ctx.get_state(ValueStateDescriptor("total", "struct<amount:decimal(18,2),n:long>"))

    def _emit(self, ctx, spend, count, cause):
        return {"card_id": ctx.get_current_key()[0], "as_of": ctx.time, "spend_24h": spend,
                "payments_24h": count, "cause": cause}

    def process_element(self, payment, ctx):
        t = ctx.timestamp()
        spend, count = self.total.value() or _NONE
        leaving = self.at.get(t - DAY_MS)  # payments exactly 24 h earlier leave now (their timer comes after this)
        if leaving is not None:
            self.at.remove(t - DAY_MS)
            spend, count = spend - leaving[0], count - leaving[1]
        here = self.at.get(t) or _NONE
        self.at.put(t, (here[0] + payment.amount, here[1] + 1))
        spend, count = spend + payment.amount, count + 1
        self.total.update((spend, count))
        ctx.timer_service().register_event_time_timer(t + DAY_MS)  # when this payment leaves the window
        yield self._emit(ctx, spend, count, "payment")

    def on_timer(self, timestamp_ms, ctx):
        leaving = self.at.get(timestamp_ms - DAY_MS)
        if leaving is None:
            return  # a payment at this very time already took them out: nothing changed
        self.at.remove(timestamp_ms - DAY_MS)
        spend, count = self.total.value() or _NONE
        spend, count = spend - leaving[0], count - leaving[1]
        if count:
            self.total.update((spend, count))
        else:
            self.total.clear()
        yield self._emit(ctx, spend, count, "expiry")


def approved(frame: DataFrame) -> DataFrame:
    return frame.where(F.col("status") == "APPROVED").select("card_id", "event_id", "event_time", "amount")


JOB = KeyedJob(
    name="rolling_spend",
    description="Per card, approved spend of the last 24 hours of event time, emitted on every change.",
    sources=(PAYMENTS,),
    keys=("card_id",),
    watermark=Watermark(out_of_orderness=timedelta(seconds=5)),
    transform=approved,
    function=RollingSpend,
    output="card_id string, as_of timestamp, spend_24h decimal(18,2), payments_24h long, cause string",
    time_column="as_of",
    sink=Table("lake.payments.rolling_spend"),
    history=timedelta(hours=24),
)
