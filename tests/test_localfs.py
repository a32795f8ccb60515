"""The streams' local file system: Hadoop's, with permissions set without forking ``chmod``."""

import os
import stat

import pytest

from streaming.spark import localfs
from streaming.settings import Settings
from streaming.spark.session import stream_session

needs_javac = pytest.mark.skipif(localfs._javac() is None, reason="no javac on this machine")  # noqa: SLF001


@needs_javac
def test_the_class_is_built_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LAKESTREAM_CACHE", str(tmp_path))
    built = localfs.classes_dir(Settings.load())
    assert built is not None and built.startswith(str(tmp_path))
    compiled = os.path.join(built, "lakestream", "hadoop", "NoForkLocalFileSystem.class")
    first = os.stat(compiled).st_mtime_ns
    assert localfs.classes_dir(Settings.load()) == built and os.stat(compiled).st_mtime_ns == first
    monkeypatch.setenv("LAKESTREAM_NO_FORK_FS", "0")
    assert localfs.classes_dir(Settings.load()) is None


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
