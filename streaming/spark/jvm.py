"""The calls that reach past PySpark's public API into Spark's own classes (py4j, PySpark's private
helpers), in one module: a Spark upgrade changes this module and the keyed binding (``spark/keyed.py``),
nothing else. Where a call has a public equivalent of lesser speed, it falls back to it.
"""

from __future__ import annotations


# py4j asks the JVM about a name every time Python reads one: ``sc._jvm.functions.col`` costs two round trips (the
# class, then its member) before the call itself, and PySpark reads it so for every ``F.col``, ``F.lit`` and ``F.when``
# and for every list of columns (``PythonUtils.toSeq``). A small stream batch made ~65 such reads per batch in its
# planning after the statistics alone, ~70 ms of round trips (bench/HISTORY.md, 2026-11-29).
_STATIC_CLASSES = ("functions", "PythonUtils", "PythonSQLUtils")


class _StaticMethods:
    """A Java class's static methods, each looked up once (py4j's own class object asks the JVM at every access)."""

    def __init__(self, java_class):
        self._java_class = java_class

    def __getattr__(self, name):
        from py4j.java_gateway import JavaMember

        if name.startswith("_"):  # (our own attributes, and Python's protocols: not Java's)
            raise AttributeError(name)
        member = getattr(self._java_class, name)
        if isinstance(member, JavaMember):  # (a method: the same object serves every later call, from any thread)
            self.__dict__[name] = member
        return member

    def __call__(self, *args):  # (the constructor)
        return self._java_class(*args)


class _Functions(_StaticMethods):
    """Spark's ``functions``, whose ``col`` also keeps the column of each name it made: a column is immutable, and
    a small batch asked for the same ~40 names every time (one round trip each, and one more to release it)."""

    _MAX_NAMES = 10_000  # (names a job builds from data would otherwise grow it without end)

    def __init__(self, java_class):
        super().__init__(java_class)
        self._columns: dict[str, object] = {}
        self._col = getattr(java_class, "col")

    def col(self, name):
        column = self._columns.get(name) if type(name) is str else None
        if column is None:
            column = self._col(name)
            if type(name) is str and len(self._columns) < self._MAX_NAMES:
                self._columns[name] = column
        return column


_CLASSES: dict[str, tuple[object, _StaticMethods]] = {}


def java_class(jvm, fqn: str) -> _StaticMethods:
    """The Java class named ``fqn`` (its constructor and static methods), found once per JVM view instead of a
    package at a time at every use (``jvm.org.apache...`` is one round trip per dot)."""
    found = _CLASSES.get(fqn)
    if found is None or found[0] is not jvm:
        from py4j.java_gateway import JavaClass

        found = _CLASSES[fqn] = (jvm, _StaticMethods(JavaClass(fqn, jvm._gateway_client)))  # noqa: SLF001
    return found[1]


def remember_static_methods(spark) -> None:
    """Make the JVM view PySpark calls through find the static methods of :data:`_STATIC_CLASSES` once per
    process instead of at every call."""
    jvm = spark.sparkContext._jvm  # noqa: SLF001
    for name in _STATIC_CLASSES:
        if isinstance(jvm.__dict__.get(name), _StaticMethods):
            continue
        try:
            jvm.__dict__[name] = (_Functions if name == "functions" else _StaticMethods)(getattr(jvm, name))
        except Exception:  # noqa: BLE001 - another Spark without this class: PySpark's lookups as they are
            continue


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
            leaf = java_class(jvm, "org.apache.spark.sql.Dataset").ofRows(jsession, relation)  # Spark 3.5
        except Exception:  # noqa: BLE001
            leaf = jvm.org.apache.spark.sql.classic.Dataset.ofRows(jsession, relation)  # Spark 4
        return DataFrame(leaf, session)
    except Exception:  # noqa: BLE001 - another Spark: the frame as it is (slower to build on, same rows)
        return frame


def referenced_columns(frame) -> set[str]:
    """The names of every attribute ``frame``'s optimised plan references or outputs (what column pruning
    left of its input)."""
    names = set(frame.columns)
    nodes = [frame._jdf.queryExecution().optimizedPlan()]  # noqa: SLF001
    while nodes:
        node = nodes.pop()
        names.update(a.name() for a in _iterate(node.references().toSeq()))
        nodes.extend(_iterate(node.children()))
    return names


def _iterate(seq):
    it = seq.iterator()
    while it.hasNext():
        yield it.next()


def observation_value(observation, name: str):
    """The metric ``name`` of an ``Observation`` once its action has run; blocks until then (PySpark's
    ``Observation.get`` converts every metric, one py4j call each)."""
    return observation._jo.get().apply(name)  # noqa: SLF001


def observation_name(observation) -> str:
    return observation._name  # noqa: SLF001


def has_class(spark, name: str) -> bool:
    """Whether the driver's JVM can load class ``name``."""
    try:
        spark._jvm.java.lang.Class.forName(name)  # noqa: SLF001 - py4j gateway
        return True
    except Exception:  # noqa: BLE001 - py4j raises its own error for a missing class: the answer, not an error
        return False


def collect_arrow(frame):
    """``frame``'s rows on the driver as Arrow record batches (Spark 3.5's Arrow collect; ``toArrow`` is 4.0's)."""
    return frame._collect_as_arrow()  # noqa: SLF001


def parse_ddl(text: str):
    """A Spark DDL schema (``"a long, b string"``) as a ``StructType``, parsed by Spark's own parser."""
    from pyspark.sql import types as T

    return T._parse_datatype_string(text)  # noqa: SLF001


def hadoop_copy(spark, source: str, target: str) -> bool:
    """Copy a file or folder with Hadoop's ``FileUtil.copy`` (any file system Spark reaches)."""
    jvm = spark._jvm  # noqa: SLF001
    conf = spark._jsc.hadoopConfiguration()  # noqa: SLF001
    src, dst = jvm.org.apache.hadoop.fs.Path(source), jvm.org.apache.hadoop.fs.Path(target)
    return bool(jvm.org.apache.hadoop.fs.FileUtil.copy(src.getFileSystem(conf), src, dst.getFileSystem(conf), dst,
                                                       False, conf))


class _Callable:
    """A Python function the JVM can call (``java.util.concurrent.Callable``) through Py4J."""

    def __init__(self, fn):
        self.fn = fn
        self.error: BaseException | None = None

    def call(self):
        try:
            self.fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the Python caller
            self.error = exc
        return None

    class Java:
        implements = ["java.util.concurrent.Callable"]


def with_iceberg_commit_properties(spark, properties: dict[str, str], fn) -> None:
    """Run ``fn`` (which commits to Iceberg tables through Spark SQL, e.g. a MERGE) so that its commits carry
    ``properties`` in their snapshot summaries (Iceberg's ``CommitMetadata.withCommitProperties``)."""
    from pyspark.java_gateway import ensure_callback_server_started

    run = _Callable(fn)
    jvm = spark._jvm  # noqa: SLF001 - Py4J is the only way to Iceberg's CommitMetadata
    ensure_callback_server_started(spark.sparkContext._gateway)  # noqa: SLF001
    props = jvm.java.util.HashMap()
    for key, value in properties.items():
        props.put(key, value)
    jvm.org.apache.iceberg.spark.CommitMetadata.withCommitProperties(props, run, jvm.java.lang.RuntimeException().getClass())
    if run.error is not None:
        raise run.error


def expire_iceberg_snapshots(spark, table_name: str, default_retention_ms: int) -> tuple[int, int]:
    """Expire the snapshots of Iceberg table ``table_name`` older than its ``history.expire.max-snapshot-age-ms``
    (``default_retention_ms`` when it has none), keeping its ``history.expire.min-snapshots-to-keep`` newest and every
    snapshot a branch or tag refers to; the files only they referenced are deleted. Returns the snapshots before and
    after."""
    import time

    jvm = spark._jvm  # noqa: SLF001 - Iceberg's table API (Spark's procedure plans a Spark job for it)
    table = java_class(jvm, "org.apache.iceberg.spark.Spark3Util").loadIcebergTable(spark._jsparkSession, table_name)  # noqa: SLF001
    count = java_class(jvm, "org.apache.iceberg.relocated.com.google.common.collect.Iterables").size
    before = count(table.snapshots())
    age = table.properties().get("history.expire.max-snapshot-age-ms")
    retention_ms = int(age) if age is not None else default_retention_ms
    table.expireSnapshots().expireOlderThan(int(time.time() * 1000) - retention_ms).commit()
    table.refresh()
    return before, count(table.snapshots())


def iceberg_current_snapshot(spark, table_name: str) -> int | None:
    """The id of Iceberg table ``table_name``'s current snapshot, read from its metadata through Iceberg's table API
    (refreshed first): None when the table has no snapshot. A query of its ``refs`` table plans and runs a Spark job
    for the same number (~0.5 s of a cold process's critical path)."""
    jvm = spark._jvm  # noqa: SLF001 - Iceberg's table API
    table = java_class(jvm, "org.apache.iceberg.spark.Spark3Util").loadIcebergTable(spark._jsparkSession, table_name)  # noqa: SLF001
    table.refresh()
    snapshot = table.currentSnapshot()
    return None if snapshot is None else int(snapshot.snapshotId())


def estimated_bytes(frame) -> int | None:
    """The size Spark's optimizer estimates for ``frame`` (for a micro-batch of files: their bytes), or None when
    it has no estimate. Costs an optimisation of the plan, not a job."""
    try:
        size = frame._jdf.queryExecution().optimizedPlan().stats().sizeInBytes()  # noqa: SLF001
        size = int(size if isinstance(size, int) else size.toString())  # (py4j hands a Scala BigInt over as an int)
    except Exception:  # noqa: BLE001 - an estimate only
        return None
    return size if 0 <= size < 2**62 else None  # (Spark says Long.MaxValue when it does not know)


def plan_now(frame) -> None:
    """Plan ``frame`` for execution now, with the session's settings of this moment: an action on the same frame
    later (``collect``) runs this plan, whatever the settings are then."""
    frame._jdf.queryExecution().executedPlan()  # noqa: SLF001
