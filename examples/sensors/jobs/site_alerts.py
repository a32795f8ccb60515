"""site_alerts: per site and hour, the overheat alerts raised and the hottest reading among them.

A job on a job (silver -> gold): its source is the table ``overheat_alerts`` writes, read as a
stream of that table's appends. The alerts arrive in the order their timers fire, so a short
out-of-orderness suffices; an alert that arrives after its hour closed goes to the late table.
"""

from datetime import timedelta

from pyspark.sql import DataFrame

from streaming.declaration import Agg, Table, Watermark, WindowedJob
from streaming.windows import Tumbling

from ..sources import ALERTS


def alerts(frame: DataFrame) -> DataFrame:
    return frame.select("site", "alert_at", "alert_key", "peak_temperature", "hot_readings")


JOB = WindowedJob(
    name="site_alerts",
    description="Per site and hour: overheat alerts raised, the hottest peak among them, hot readings behind them.",
    sources=(ALERTS,),
    keys=("site",),
    window=Tumbling(size=timedelta(hours=1)),
    watermark=Watermark(out_of_orderness=timedelta(minutes=10)),
    transform=alerts,
    aggregates=(
        Agg.count("alerts"),
        Agg.max("peak_temperature", "peak_temperature"),
        Agg.sum("hot_readings", "hot_readings"),
    ),
    sink=Table("lake.sensors.site_alerts"),
    owner="iot",
)
