"""The project's sources: what lands, in which format, with which rules."""

from streaming.declaration import Field, Source

READINGS = Source(
    name="sensor_readings",
    description="One reading per device every few seconds, as CSV files with a header line.",
    format="csv",
    header=True,
    delimiter=",",
    event_time="read_at",
    dedup_key="reading_id",
    fields=(
        Field("reading_id", "string", pattern=r"^r-[0-9a-f]{1,32}$"),
        Field("device_id", "string", pattern=r"^dev-[0-9]{3}$"),
        Field("site", "enum", choices=("north", "south", "east")),
        Field("read_at", "timestamp"),
        Field("temperature", "double"),
        Field("humidity", "decimal(5,2)", required=False),
        Field("battery_ok", "boolean"),
    ),
)

# A table written by another job of this project: overheat_alerts' output feeds site_alerts (silver ->
# gold). Its natural key (device, spell start) is the dedup key; the stream follows the table's appends.
ALERTS = Source(
    name="overheat_alerts",
    description="The alerts overheat_alerts writes, read as a stream of the table's appended snapshots.",
    format="table",
    location="lake.sensors.overheat_alerts",
    event_time="alert_at",
    dedup_key="alert_key",
    dedup_from=("device_id", "hot_since"),
    fields=(
        Field("alert_key", "string"),
        Field("device_id", "string", pattern=r"^dev-[0-9]{3}$"),
        Field("site", "enum", choices=("north", "south", "east")),
        Field("hot_since", "timestamp"),
        Field("alert_at", "timestamp"),
        Field("peak_temperature", "double"),
        Field("hot_readings", "long"),
    ),
)
