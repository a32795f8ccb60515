"""A class-data archive for the driver's JVM (Java's application class-data sharing, JDK 13+).

A cold Spark driver spends seconds loading and verifying the same few thousand classes on every start: the
session, the analyser, Iceberg's catalog, the first micro-batch's operators. Java can write the classes a
process loaded to an archive when it exits (``-XX:ArchiveClassesAtExit``) and map them from there in later
processes (``-XX:SharedArchiveFile``), already parsed and verified. On this machine a stream started from a
shell reached its first commit ~3.5 s sooner with the archive (14.6 s against 18.1 s, medians of five pairs).

The first process of a machine that starts a session through :func:`session.get_spark` records the archive
(its run is slower, ~30 %, once) into ``settings.cache_dir``, named by a digest of everything the archive
depends on: the Java runtime, the class path (Spark's jars, the extra class path) and the heap size. Later
processes with the same digest map it; a different Java, Spark or class path makes a new name, and so a
new recording. The JVM checks the archive itself as well and ignores one that does not match.

Only the first process records, and only when asked (``get_spark(..., record_classes=True)``, the default): a
long-lived process (a test session) should not, as its archive would be written at its exit.

Safety: a truncated archive crashes the JVM that maps it, so an archive is written under a temporary name,
checked by a Java run that maps it, and only then renamed into place (atomic; a process that already
mapped the older file keeps it); its size is kept beside it and an archive of another size is not mapped. One process records at a time (a lock file; a lock older than
``_STALE_S`` is taken over). A JVM started with a flight recording or an agent (:data:`HOOKS`) neither maps nor records
it. ``LAKESTREAM_CLASS_ARCHIVE=0`` turns all of it off.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .localfs import spark_jars

log = logging.getLogger(__name__)
_STALE_S = 15 * 60
# The JVM's own messages about the archive (a class it cannot archive, an archive it ignores): not the user's.
QUIET = "-Xlog:cds*=off -Xlog:class+path*=off"


def _java() -> str | None:
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    return java if java and os.path.exists(java) else None


def digest(conf: dict[str, str], java: str) -> str:
    """What the archive depends on: the Java runtime (its binary and its VM library), Spark's jars, the
    driver's extra class path and its heap size (compressed object pointers depend on it)."""
    h = hashlib.sha256()
    real = os.path.realpath(java)
    parts = [real]
    runtime = Path(real).parent.parent
    for candidate in [Path(real), *sorted(runtime.glob("lib/server/libjvm.*")), *sorted(runtime.glob("lib/server/*.jsa"))]:
        st = candidate.stat()
        parts.append(f"{candidate.name}:{st.st_size}:{st.st_mtime_ns}")
    for jar in sorted(spark_jars().glob("*.jar")):
        st = jar.stat()
        parts.append(f"{jar.name}:{st.st_size}:{st.st_mtime_ns}")
    for entry in filter(None, conf.get("spark.driver.extraClassPath", "").split(os.pathsep)):
        st = os.stat(entry)
        parts.append(f"{entry}:{st.st_size}:{st.st_mtime_ns}")
    parts.append(conf.get("spark.driver.memory", ""))
    h.update("\n".join(parts).encode())
    return h.hexdigest()[:16]


# Options that hook the JVM's loading of classes (a flight recording, a Java or native agent). Java 17 mapping the
# archive under a flight recording crashed at startup (SIGSEGV in KlassFactory::check_shared_class_file_load_hook,
# 2026-11-30): a process started with one of these neither maps nor records the archive.
HOOKS = ("-XX:StartFlightRecording", "-XX:+FlightRecorder", "-javaagent:", "-agentlib:", "-agentpath:")


def hooked(conf: dict[str, str]) -> str | None:
    """The option of the driver's JVM that hooks its class loading, if any (see :data:`HOOKS`)."""
    for option in conf.get("spark.driver.extraJavaOptions", "").split():
        for hook in HOOKS:
            if option.startswith(hook):
                return hook.rstrip(":")
    return None


def _paths(settings, conf: dict[str, str]) -> tuple[Path, str] | None:
    if not settings.class_archive:
        return None
    hook = hooked(conf)
    if hook is not None:
        log.info("no class archive for a JVM started with %s: it starts ~3 s slower", hook)
        return None
    java = _java()
    if java is None:
        return None
    try:
        return Path(settings.cache_dir) / f"jvm-classes-{digest(conf, java)}.jsa", java
    except OSError as exc:  # a class path entry that is not there: Spark will say so itself
        log.debug("no class archive: %s", exc)
        return None


def _private(path: Path) -> bool:
    """The JVM maps the archive's code: one another user could write is not used."""
    info = os.stat(path)
    return info.st_uid == os.getuid() and not info.st_mode & 0o022


def use(settings, conf: dict[str, str]) -> str | None:
    """The archive to map for these settings, when one was recorded (else None)."""
    found = _paths(settings, conf)
    if found is None:
        return None
    archive, _ = found
    try:
        if not (archive.is_file() and _private(archive) and _private(archive.parent)):
            return None
        # A damaged (truncated) archive crashes the JVM that maps it: map only the size that was published.
        if _size_file(archive).read_text().strip() != str(archive.stat().st_size):
            log.warning("the class archive %s is not the size it was written with; not used (remove it to record "
                        "it again)", archive)
            return None
        return str(archive)
    except (OSError, ValueError):
        return None


def _size_file(archive: Path) -> Path:
    return archive.with_suffix(".size")


@dataclass
class Recording:
    """This process records the archive: its JVM writes it at exit; :meth:`finish` checks and publishes it."""

    archive: Path
    partial: Path
    lock: Path
    java: str

    def option(self) -> str:
        return f"-XX:ArchiveClassesAtExit={self.partial} {QUIET}"

    def watch(self) -> None:
        atexit.register(self.finish)

    def finish(self) -> None:
        """At this process's exit: let the driver's JVM exit (it writes the archive as it does), check the
        archive maps, and rename it into place."""
        try:
            from pyspark import SparkContext

            gateway = getattr(SparkContext, "_gateway", None)
            proc = getattr(gateway, "proc", None)
            if proc is None:
                return
            print("lakestream: writing the JVM's class archive (once per machine; later starts are faster)...",
                  file=sys.stderr, flush=True)
            active = SparkContext._active_spark_context  # noqa: SLF001 - stopped first: its accumulator server
            if active is not None:                        # would otherwise print the JVM's exit as an EOFError
                active.stop()
            try:
                if proc.stdin is not None:
                    proc.stdin.close()  # the gateway exits when its standard input closes
                proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                return
            if proc.returncode == 0 and self.partial.is_file() and self.partial.stat().st_size > 1 << 20 and _maps(
                    self.java, self.partial):
                os.chmod(self.partial, 0o444)
                _size_file(self.archive).write_text(f"{self.partial.stat().st_size}\n")
                os.replace(self.partial, self.archive)
        except Exception as exc:  # noqa: BLE001 - an optimisation never fails the command
            log.debug("class archive not written: %s", exc)
        finally:
            for path in (self.partial, self.lock):
                try:
                    path.unlink()
                except OSError:
                    pass


def _maps(java: str, archive: Path) -> bool:
    """Whether a JVM starts with ``archive`` mapped (a damaged archive crashes the JVM that maps it)."""
    try:
        out = subprocess.run([java, f"-XX:SharedArchiveFile={archive}", *QUIET.split(), "-version"],
                             capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0


def _abandoned(lock: Path) -> bool:
    """Whether the process that holds ``lock`` is gone (or the lock is older than any recording takes)."""
    try:
        if time.time() - lock.stat().st_mtime > _STALE_S:
            return True
        pid = int(lock.read_text().strip() or 0)
    except (OSError, ValueError):
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def record(settings, conf: dict[str, str]) -> Recording | None:
    """A recording for this process, when no archive exists yet and no other process is recording one."""
    found = _paths(settings, conf)
    if found is None:
        return None
    archive, java = found
    if archive.exists():
        if use(settings, conf) is not None or not _private(archive.parent):
            return None
        archive.unlink(missing_ok=True)  # damaged, or of an older layout: recorded again
    cache = archive.parent
    try:
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _private(cache):
            return None
        lock = archive.with_suffix(".recording")
        if lock.exists() and _abandoned(lock):  # a recorder that died (killed): its lock is taken over
            lock.unlink(missing_ok=True)
            for partial in cache.glob(f"{archive.stem}.*.partial"):
                partial.unlink(missing_ok=True)
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError:  # another process records it, or the cache cannot be written
        return None
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return Recording(archive=archive, partial=archive.with_suffix(f".{os.getpid()}.partial"), lock=lock, java=java)
