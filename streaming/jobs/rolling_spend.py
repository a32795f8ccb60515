"""rolling_spend: per card, approved spend over the last 24 hours of event time, on every change.

Grain: one row per change of a card's 24-hour spend: a payment enters (``cause = payment``) or an
earlier one leaves the window (``cause = expiry``, at exactly 24 h after it, by an event-time
timer). The window at time ``x`` holds the payments with ``x - 24h < event_time <= x``. State:
the card's payments of the last 24 hours, pruned as they expire.
"""

from datetime import timedelta

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from streaming.declaration import KeyedJob, Table, Watermark
from streaming.keyed import KeyedProcessFunction, ListStateDescriptor, RuntimeContext
from streaming.jobs.sources import PAYMENTS

DAY = timedelta(hours=24)


class RollingSpend(KeyedProcessFunction):
    def open(self, ctx: RuntimeContext) -> None:
        self.recent = ctx.get_state(ListStateDescriptor("recent", "struct<t:timestamp,amount:decimal(18,2)>"))

    def _emit(self, ctx, entries, cause):
        spend = sum((a for _, a in entries), start=0)
        return {"card_id": ctx.get_current_key()[0], "as_of": ctx.time, "spend_24h": spend,
                "payments_24h": len(entries), "cause": cause}

    def process_element(self, payment, ctx):
        t = ctx.time
        entries = [(pt, a) for pt, a in self.recent.get() if pt > t - DAY] + [(t, payment.amount)]
        self.recent.update(entries)
        ctx.timer_service().register_event_time_timer(t + DAY)  # when this payment leaves the window
        yield self._emit(ctx, entries, "payment")

    def on_timer(self, timestamp_ms, ctx):
        entries = self.recent.get()
        kept = [(pt, a) for pt, a in entries if pt > ctx.time - DAY]
        if len(kept) == len(entries):
            return  # a payment at this very time already pruned it: nothing changed
        if kept:
            self.recent.update(kept)
        else:
            self.recent.clear()
        yield self._emit(ctx, kept, "expiry")


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
