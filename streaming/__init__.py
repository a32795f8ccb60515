"""lakestream: Flink-grade event time on Spark Structured Streaming."""

__version__ = "0.1.0"
