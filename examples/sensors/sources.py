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
