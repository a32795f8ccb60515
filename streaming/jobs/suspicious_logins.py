"""suspicious_logins: per user, 3 or more consecutive FAILED logins followed by a SUCCESS, all
within 5 minutes (the success at most 5 minutes after the first failure counted).

Grain: one row per matching SUCCESS. A pattern matched on keyed state: the times of the user's
consecutive failures of the last 5 minutes (an event-time timer forgets each failure 5 minutes
after it), so the state never holds more than the 5-minute horizon.
"""

from datetime import timedelta

from pyspark.sql import DataFrame

from streaming.declaration import KeyedJob, Table, Watermark
from streaming.keyed import KeyedProcessFunction, ListStateDescriptor, RuntimeContext
from streaming.jobs.sources import LOGINS

HORIZON = timedelta(minutes=5)
MIN_FAILURES = 3


class FailuresThenSuccess(KeyedProcessFunction):
    def open(self, ctx: RuntimeContext) -> None:
        self.failures = ctx.get_state(ListStateDescriptor("failures", "timestamp"))

    def process_element(self, login, ctx):
        t = ctx.time
        recent = [f for f in self.failures.get() if f >= t - HORIZON]
        if login.status == "FAILED":
            self.failures.update(recent + [t])
            ctx.timer_service().register_event_time_timer(t + HORIZON)  # forget it once out of reach
            return
        if len(recent) >= MIN_FAILURES:
            yield {"user_id": login.user_id, "event_id": login.event_id, "success_time": login.event_time,
                   "success_ip": login.ip, "failed_count": len(recent), "first_failure": min(recent),
                   "last_failure": max(recent)}
        self.failures.clear()  # a success ends the run of failures

    def on_timer(self, timestamp_ms, ctx):
        kept = [f for f in self.failures.get() if f > ctx.time - HORIZON]
        if kept:
            self.failures.update(kept)
        else:
            self.failures.clear()


def logins(frame: DataFrame) -> DataFrame:
    return frame.select("user_id", "event_id", "event_time", "status", "ip")


JOB = KeyedJob(
    name="suspicious_logins",
    description="3+ consecutive failed logins followed by a success within 5 minutes, per user.",
    sources=(LOGINS,),
    keys=("user_id",),
    watermark=Watermark(out_of_orderness=timedelta(seconds=5)),
    transform=logins,
    function=FailuresThenSuccess,
    output="user_id string, event_id string, success_time timestamp, success_ip string, failed_count long, "
           "first_failure timestamp, last_failure timestamp",
    time_column="success_time",
    sink=Table("lake.fraud.suspicious_logins"),
    history=timedelta(minutes=5),
    owner="fraud",
)
