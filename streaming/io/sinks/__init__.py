"""Sinks: one exactly-once interface (``base``) over Iceberg (``iceberg``) and Delta (``delta``).

``sink_for`` picks the format from the settings (``format``, or ``jobs.<job>.format``), so any job's
tables move between Iceberg and Delta by configuration alone.
"""

from __future__ import annotations

from ...declaration import Table
from ...settings import Settings
from .base import COMMIT_KEY, OP, WATERMARK_KEY, Commit, Sink, is_conflict, with_retries
from .delta import DeltaRsSink, DeltaSparkSink
from .iceberg import IcebergSink

__all__ = ["COMMIT_KEY", "OP", "WATERMARK_KEY", "Commit", "Sink", "is_conflict", "with_retries", "sink_for",
           "IcebergSink", "DeltaRsSink", "DeltaSparkSink"]


def delta_spark_available(spark) -> bool:
    from ...spark.jvm import has_class

    return has_class(spark, "io.delta.sql.DeltaSparkSessionExtension")


def sink_for(spark, settings: Settings, table: Table, job: str | None = None) -> Sink:
    """The sink of ``table`` in the format configured for ``job``."""
    if settings.format_of(job) == "iceberg":
        return IcebergSink(spark, table)
    if settings.delta_engine == "spark":
        from ...errors import ConfigError

        if not delta_spark_available(spark):
            raise ConfigError(
                "delta.engine is 'spark' but delta-spark's jars are not on the Spark classpath; add them "
                "(spark.conf: {spark.jars: /path/delta-spark_2.12-3.2.0.jar,...}) or use delta.engine: delta-rs"
            )
        return DeltaSparkSink(spark, table, settings.delta_root, settings.delta_storage_options)
    return DeltaRsSink(spark, table, settings.delta_root, settings.delta_storage_options)
