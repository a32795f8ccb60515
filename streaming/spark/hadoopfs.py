"""Small file operations through Spark's Hadoop FileSystem, so checkpoint-side files work on any
URI Spark can reach (local disk, HDFS, s3a://, abfss://, gs://).

Local paths take a short cut through Python's own file functions: Hadoop's local file system
without its native library forks ``chmod``/``readlink`` for every file it creates or renames,
which a micro-batch pays several times. (No ``.crc`` twin is written; one left by Hadoop is removed
with its file, so Hadoop never checks a file against a stale checksum.)"""

from __future__ import annotations

import os
import shutil

from .jvm import java_class


def _local(path: str) -> str | None:
    """The local file-system path of ``path``, or None when it lives elsewhere."""
    if path.startswith("file:"):
        rest = path[5:]
        return "/" + rest.lstrip("/") if rest.startswith("/") else rest
    return None if "://" in path or path.startswith(("hdfs:", "s3", "gs:", "abfs", "wasb", "memory:")) else path


def _crc(path: str) -> str:
    head, name = os.path.split(path)
    return os.path.join(head, f".{name}.crc")


class HadoopFS:
    def __init__(self, spark):
        self._spark = spark
        self._jvm = spark._jvm  # noqa: SLF001 - Py4J gateway is the only way in
        self._conf = spark._jsc.hadoopConfiguration()  # noqa: SLF001

    def _path(self, path: str):
        return java_class(self._jvm, "org.apache.hadoop.fs.Path")(path)

    def _fs(self, path: str):
        return self._path(path).getFileSystem(self._conf)

    def exists(self, path: str) -> bool:
        local = _local(path)
        if local is not None:
            return os.path.exists(local)
        return bool(self._fs(path).exists(self._path(path)))

    def read_text(self, path: str) -> str:
        """The file's text; FileNotFoundError when it is missing (also when it vanishes meanwhile)."""
        local = _local(path)
        if local is not None:
            with open(local, encoding="utf-8") as f:
                return f.read()
        fs = self._fs(path)
        try:
            stream = fs.open(self._path(path))
        except Exception as exc:  # Py4JJavaError wrapping java.io.FileNotFoundException
            if "FileNotFoundException" in str(exc):
                raise FileNotFoundError(path) from None
            raise
        try:
            scanner = self._jvm.java.util.Scanner(stream, "UTF-8").useDelimiter("\\A")
            return scanner.next() if scanner.hasNext() else ""
        finally:
            stream.close()

    def write_text(self, path: str, text: str) -> None:
        """Write atomically: to a hidden temporary file, then rename over the target."""
        local = _local(path)
        if local is not None:
            folder, name = os.path.split(local)
            os.makedirs(folder or ".", exist_ok=True)
            tmp = os.path.join(folder, f".{name}.tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            if os.path.exists(_crc(local)):
                os.remove(_crc(local))
            os.replace(tmp, local)
            return
        fs = self._fs(path)
        target = self._path(path)
        tmp = self._path(f"{target.getParent().toString()}/.{target.getName()}.tmp")
        out = fs.create(tmp, True)
        try:
            out.write(bytearray(text.encode("utf-8")))
        finally:
            out.close()
        if fs.exists(target):
            fs.delete(target, False)
        if not fs.rename(tmp, target):
            raise OSError(f"could not rename {tmp} to {target}")

    def list_names(self, path: str) -> list[str]:
        local = _local(path)
        if local is not None:
            return os.listdir(local) if os.path.isdir(local) else []
        fs = self._fs(path)
        if not fs.exists(self._path(path)):
            return []
        return [status.getPath().getName() for status in fs.listStatus(self._path(path))]

    names = list_names  # the ``layout.Files`` interface

    def delete(self, path: str) -> None:
        local = _local(path)
        if local is not None:
            if os.path.isdir(local) and not os.path.islink(local):
                shutil.rmtree(local, ignore_errors=True)
            elif os.path.lexists(local):
                os.remove(local)
            if os.path.exists(_crc(local)):
                os.remove(_crc(local))
            return
        fs = self._fs(path)
        if fs.exists(self._path(path)):
            fs.delete(self._path(path), True)

    def size(self, path: str) -> int:
        """Bytes under ``path`` (0 if missing)."""
        fs = self._fs(path)
        if not fs.exists(self._path(path)):
            return 0
        return int(fs.getContentSummary(self._path(path)).getLength())

    def mkdirs(self, path: str) -> None:
        self._fs(path).mkdirs(self._path(path))

    def rename(self, source: str, target: str) -> None:
        """Move ``source`` to ``target`` (a folder rename is atomic on HDFS and local disks)."""
        fs = self._fs(source)
        if not fs.rename(self._path(source), self._path(target)):
            raise OSError(f"could not rename {source} to {target}")
