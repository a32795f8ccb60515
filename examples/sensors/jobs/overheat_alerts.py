"""overheat_alerts: a device whose every reading stays above 80 degrees for 5 minutes raises an alert.

Grain: one row per overheating spell that lasts ``HOLD``: the first hot reading starts a spell and
an event-time timer at ``start + HOLD``; a reading at or below the threshold ends the spell (and
deletes the timer). When the timer fires the spell is still on: the alert is written.
"""

from datetime import timedelta

from pyspark.sql import DataFrame

from streaming.declaration import KeyedJob, Table, Watermark
from streaming.keyed import KeyedProcessFunction, RuntimeContext, TtlConfig, ValueStateDescriptor

from ..sources import READINGS

THRESHOLD = 80.0
HOLD = timedelta(minutes=5)


class Overheat(KeyedProcessFunction):
    def open(self, ctx: RuntimeContext) -> None:
        self.spell = ctx.get_state(ValueStateDescriptor(
            "spell", "struct<since:timestamp,peak:double,readings:long,site:string>", ttl=TtlConfig(timedelta(hours=6))))

    def process_element(self, reading, ctx):
        spell = self.spell.value()
        timers = ctx.timer_service()
        if reading.temperature > THRESHOLD:
            if spell is None:
                self.spell.update((ctx.time, reading.temperature, 1, reading.site))
                timers.register_event_time_timer(ctx.time + HOLD)
            else:
                self.spell.update((spell[0], max(spell[1], reading.temperature), spell[2] + 1, spell[3]))
        elif spell is not None:
            timers.delete_event_time_timer(spell[0] + HOLD)
            self.spell.clear()
        return ()

    def on_timer(self, timestamp_ms, ctx):
        spell = self.spell.value()
        if spell is not None and spell[0] + HOLD == ctx.time:
            yield {"device_id": ctx.get_current_key()[0], "site": spell[3], "hot_since": spell[0],
                   "alert_at": ctx.time, "peak_temperature": spell[1], "hot_readings": spell[2]}


def readings(frame: DataFrame) -> DataFrame:
    return frame.select("device_id", "site", "read_at", "reading_id", "temperature")


JOB = KeyedJob(
    name="overheat_alerts",
    description="A device above 80 degrees in every reading for 5 minutes: one alert per spell.",
    sources=(READINGS,),
    keys=("device_id",),
    watermark=Watermark(out_of_orderness=timedelta(seconds=30)),
    transform=readings,
    function=Overheat,
    output="device_id string, site string, hot_since timestamp, alert_at timestamp, peak_temperature double, "
           "hot_readings long",
    time_column="alert_at",
    sink=Table("lake.sensors.overheat_alerts"),
    history=HOLD,
    owner="iot",
)
