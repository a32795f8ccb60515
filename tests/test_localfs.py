"""The streams' local file system: Hadoop's, with permissions set without forking ``chmod``."""

import os
import stat
import zipfile

import pytest

from streaming.spark import localfs
from streaming.settings import Settings
from streaming.spark.session import stream_session

needs_javac = pytest.mark.skipif(localfs._javac() is None, reason="no javac on this machine")  # noqa: SLF001


@needs_javac
def test_the_class_is_built_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LAKESTREAM_CACHE", str(tmp_path))
    built = localfs.class_jar(Settings.load())
    assert built is not None and built.startswith(str(tmp_path)) and built.endswith(".jar")
    with zipfile.ZipFile(built) as jar:
        assert "lakestream/hadoop/NoForkLocalFileSystem.class" in jar.namelist()
    first = os.stat(built).st_mtime_ns
    assert localfs.class_jar(Settings.load()) == built and os.stat(built).st_mtime_ns == first
    monkeypatch.setenv("LAKESTREAM_NO_FORK_FS", "0")
    assert localfs.class_jar(Settings.load()) is None


def _file_system(session, path: str):
    jvm = session._jvm  # noqa: SLF001
    conf = session._jsparkSession.sessionState().newHadoopConf()  # noqa: SLF001
    return jvm.org.apache.hadoop.fs.FileSystem.get(jvm.java.net.URI(f"file://{path}"), conf)


@needs_javac
def test_a_stream_session_writes_local_files_with_their_permissions_and_checksums(spark, tmp_path):
    assert localfs.loadable(spark), "the session's driver class path lacks the no-fork file system"
    streams = stream_session(spark, Settings.load())
    fs = _file_system(streams, str(tmp_path))
    assert fs.getClass().getName() == localfs.FS_CLASS
    # the session's other queries keep Hadoop's own file system
    assert _file_system(spark, str(tmp_path)).getClass().getName() != localfs.FS_CLASS

    jvm = spark._jvm  # noqa: SLF001
    path = jvm.org.apache.hadoop.fs.Path(f"file://{tmp_path}/sub/part-0.txt")
    out = fs.create(path, True)
    out.write(b"hello")
    out.close()
    written = tmp_path / "sub" / "part-0.txt"
    assert written.read_bytes() == b"hello"
    assert (tmp_path / "sub" / ".part-0.txt.crc").exists()  # still checksummed
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(written.stat().st_mode) == 0o666 & ~umask

    fs.setPermission(path, jvm.org.apache.hadoop.fs.permission.FsPermission.createImmutable(0o640))
    assert stat.S_IMODE(written.stat().st_mode) == 0o640
    assert fs.open(path).read() == ord("h")  # read back through the checksummed stream


@needs_javac
def test_a_watched_landing_folder_is_listed_once_it_changes(spark, tmp_path):
    """An idle stream does not list its landing folder over and over: a listing of a watched folder waits
    until the folder changes (a new file is seen within a step) or the longest wait has passed."""
    import threading
    import time

    landing = tmp_path / "landing"
    landing.mkdir()
    (landing / "a.jsonl").write_text("{}\n")
    streams = stream_session(spark, Settings.load(), [str(landing)])
    assert streams.conf.get("lakestream.watch.folders") == str(landing)
    streams.conf.set("lakestream.watch.max.ms", "700")
    fs = _file_system(streams, str(tmp_path))
    jvm = spark._jvm  # noqa: SLF001
    folder = jvm.org.apache.hadoop.fs.Path(f"file://{landing}")

    def names() -> set[str]:
        return {s.getPath().getName() for s in fs.listStatus(folder)}

    assert names() == {"a.jsonl"}  # the first listing does not wait
    t = time.monotonic()
    assert names() == {"a.jsonl"}
    assert time.monotonic() - t >= 0.6  # unchanged: waited (about) the longest wait, then listed
    threading.Timer(0.2, lambda: (landing / "b.jsonl").write_text("{}\n")).start()
    t = time.monotonic()
    assert names() == {"a.jsonl", "b.jsonl"}  # the new file ends the wait
    assert time.monotonic() - t < 0.6
    other = tmp_path / "other"
    other.mkdir()
    t = time.monotonic()
    fs.listStatus(jvm.org.apache.hadoop.fs.Path(f"file://{other}"))
    fs.listStatus(jvm.org.apache.hadoop.fs.Path(f"file://{other}"))
    assert time.monotonic() - t < 0.5  # a folder nobody watches is listed as Hadoop lists it


def test_streams_without_a_watched_folder_poll_slower_when_idle(spark, tmp_path):
    """Where the file system cannot watch (an object store, or no javac), an empty listing is followed by a
    pause instead of Spark's 10 ms, so an idle stream neither burns a core nor hammers the store."""
    from streaming.spark.session import IDLE_POLL_MS

    streams = stream_session(spark, Settings.load(), ["s3a://bucket/landing/payments"])
    assert streams.conf.get("spark.sql.streaming.pollingDelay") == f"{IDLE_POLL_MS}ms"
    assert streams.conf.get("lakestream.watch.folders", None) is None
    assert spark.conf.get("spark.sql.streaming.pollingDelay") != f"{IDLE_POLL_MS}ms"  # (the parent keeps Spark's)
