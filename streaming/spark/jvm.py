"""The calls that reach past PySpark's public API into Spark's own classes, in one module: a Spark
upgrade changes this module and the keyed binding (``spark/keyed.py``), nothing else. Each call falls
back to the public API's result when the class or method it needs is not there.
"""

from __future__ import annotations


def clone_session(spark):
    """A copy of ``spark``'s session (settings, catalogs, temporary views), or ``spark`` itself when this
    Spark cannot clone one."""
    from pyspark.sql import SparkSession

    try:
        return SparkSession(spark.sparkContext, spark._jsparkSession.cloneSession())  # noqa: SLF001 - Spark 3.5 and 4
    except Exception:  # noqa: BLE001 - another Spark: the session as it is
        return spark


def cached_leaf(frame):
    """A DataFrame over ``frame``'s cache (``frame`` persisted) whose plan is that cache alone, not the plan
    that fills it. Every DataFrame built on it is analysed, and every query over it optimised and matched
    against the cache, over one node instead of the whole plan below: over a batch's parsed lines (a
    few hundred expressions) a ``where`` took ~5 ms to build, ~1 ms on the leaf, and a batch builds dozens.
    The cache keeps its lineage: read after an ``unpersist``, it is computed again. ``frame`` itself when
    the cache is not found or this Spark has no such entry points."""
    from pyspark.sql import DataFrame

    session = frame.sparkSession
    jsession = session._jsparkSession  # noqa: SLF001
    try:
        found = jsession.sharedState().cacheManager().lookupCachedData(frame._jdf.queryExecution().analyzed())  # noqa: SLF001
        if found.isEmpty():
            return frame
        relation = found.get().cachedRepresentation()
        jvm = session._jvm  # noqa: SLF001
        try:
            leaf = jvm.org.apache.spark.sql.Dataset.ofRows(jsession, relation)  # Spark 3.5
        except Exception:  # noqa: BLE001
            leaf = jvm.org.apache.spark.sql.classic.Dataset.ofRows(jsession, relation)  # Spark 4
        return DataFrame(leaf, session)
    except Exception:  # noqa: BLE001 - another Spark: the frame as it is (slower to build on, same rows)
        return frame
