"""Dagster resources: lakestream's settings, and the ecosystem's own resources built from them
(dagster-pyspark's ``LazyPySparkResource``, dagster-dbt's ``DbtCliResource``)."""

from __future__ import annotations

from typing import Any

import dagster as dg
from dagster_pyspark import LazyPySparkResource
from dagster_pyspark.resources import spark_session_from_config
from pydantic import Field

from streaming.spark import session as spark_session
from streaming.spark.session import check_java, prepare_environment, spark_conf
from streaming.settings import Settings


class LakestreamResource(dg.ConfigurableResource):
    """Where the lakehouse lives: ``home`` (default $LAKESTREAM_HOME or ./.lake) and an optional YAML file."""

    home: str | None = None
    # A code location of its own (``definitions_for``) names its file: its settings then come from that file and
    # its home alone, not from LAKESTREAM_* variables another location may need set otherwise.
    config_file: str | None = None

    def settings(self) -> Settings:
        return load_settings(self.config_file, self.home)

    def spark(self, pyspark: LazyPySparkResource):
        """The run's SparkSession, built by dagster-pyspark from lakestream's conf, after lakestream's
        startup checks (Java, Python workers). It becomes the process's shared session."""
        settings = self.settings()
        if spark_session.active_session() is not None:  # e.g. an in-process test run
            return spark_session.active_session()
        check_java(bundled=settings.bundled_java)
        prepare_environment(settings.spark_master.startswith("local"))
        session = pyspark.spark_session
        session.sparkContext.setLogLevel("ERROR")
        spark_session.adopt(session)  # one session per process
        return session


class LakestreamPySpark(LazyPySparkResource):
    """dagster-pyspark's lazy SparkSession, with lakestream's conf worked out where the run runs (from
    its settings: master, catalogs, jars, paths), so the launchpad shows no machine-specific paths;
    ``spark_config`` holds only the user's overrides."""

    spark_config: dict[str, Any] = Field(default_factory=dict, description="Spark settings that override "
                                         "lakestream's (which come from lakestream.yaml / LAKESTREAM_* variables)")
    home: str | None = Field(None, description="LAKESTREAM_HOME for the conf (default: the environment's)")
    config_file: str | None = Field(None, description="the location's lakestream.yaml (default: the environment's; "
                                    "given, LAKESTREAM_* variables are ignored)")

    def _init_session(self) -> None:
        if self._spark_session is None:
            settings = load_settings(self.config_file, self.home)
            self._spark_session = spark_session_from_config({**spark_conf(settings), **self.spark_config})


def pyspark_resource(settings: Settings, home: str | None = None, config_file: str | None = None) -> LazyPySparkResource:
    """dagster-pyspark's resource with exactly the conf lakestream's own builder uses."""
    return LakestreamPySpark(home=home, config_file=config_file)


def load_settings(config_file: str | None, home: str | None) -> Settings:
    """A location's settings: from the environment (LAKESTREAM_*), or, given a ``config_file`` (a code location of
    its own), from that file and ``home`` only."""
    import os

    environ = {k: v for k, v in os.environ.items() if not k.startswith("LAKESTREAM_")} if config_file else None
    return Settings.load(environ, config_file=config_file, home=home)
