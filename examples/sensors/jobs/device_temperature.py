"""device_temperature: per device, 10-minute windows sliding every minute: readings, sum, min, max.

The sliding average is ``temperature_sum / readings`` (aggregates merge across micro-batches and
late corrections, so the table keeps sums and counts; a dbt model or a query divides them).
"""

from datetime import timedelta

from pyspark.sql import DataFrame

from streaming.declaration import Agg, Table, Watermark, WindowedJob
from streaming.windows import Sliding

from ..sources import READINGS


def measures(readings: DataFrame) -> DataFrame:
    return readings.select("device_id", "read_at", "reading_id", "temperature")


JOB = WindowedJob(
    name="device_temperature",
    description="Per device, 10-minute windows every minute: readings, temperature sum, min and max.",
    sources=(READINGS,),
    keys=("device_id",),
    window=Sliding(size=timedelta(minutes=10), every=timedelta(minutes=1)),
    watermark=Watermark(out_of_orderness=timedelta(seconds=30)),
    transform=measures,
    aggregates=(
        Agg.count("readings"),
        Agg.sum("temperature", "temperature_sum"),
        Agg.min("temperature", "temperature_min"),
        Agg.max("temperature", "temperature_max"),
    ),
    sink=Table("lake.sensors.device_temperature"),
    owner="iot",
)
