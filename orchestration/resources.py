"""Dagster resources: the lakestream settings, and dagster-pyspark's resource built from them."""


import os

import dagster as dg
from dagster_pyspark import LazyPySparkResource

from streaming.session import check_java, get_spark, prepare_environment, spark_conf
from streaming.settings import Settings


class LakestreamResource(dg.ConfigurableResource):
    """Where the lakehouse lives: ``home`` (default $LAKESTREAM_HOME or ./.lake) and an optional YAML file."""

    home: str | None = None
    config_file: str | None = None

    def settings(self) -> Settings:
        env = dict(os.environ)
        if self.home:
            env["LAKESTREAM_HOME"] = self.home
        return Settings.load(env, config_file=self.config_file)

    def spark(self, pyspark: LazyPySparkResource):
        """The SparkSession, after lakestream's startup checks (Java, Iceberg jar)."""
        settings = self.settings()
        check_java()
        prepare_environment(settings.spark_master.startswith("local"))
        if not pyspark.spark_config:
            return get_spark(settings)
        return pyspark.spark_session


def pyspark_resource(settings: Settings) -> LazyPySparkResource:
    """dagster-pyspark's resource with exactly the conf lakestream's own builder uses."""
    return LazyPySparkResource(spark_config=spark_conf(settings))
