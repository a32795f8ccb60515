"""Access to a folder on any file system fsspec knows, without a JVM: what checkpoint inspection, the health
sensor and the landing observation read (fast enough for a sensor every 30 s), and the few small files the
checkpoint's lease writes (an exclusive create is atomic on local disks and, through s3fs, on S3)."""

from __future__ import annotations

import os
from datetime import datetime, timezone
from typing import Any, Mapping
from urllib.parse import unquote, urlparse

import fsspec
from fsspec.implementations.local import LocalFileSystem


class Tree:
    """Access to a folder on any file system fsspec knows, without a JVM: local paths and
    ``file:`` URIs, ``s3a://`` / ``s3://`` (with s3fs), ``abfss://`` (adlfs), ``gs://`` (gcsfs),
    ``hdfs://`` (pyarrow), ``memory://`` (tests). Paths below the root are joined with ``/``."""

    def __init__(self, uri: str, storage_options: Mapping[str, Any] | None = None):
        try:
            self.fs, self.root = fsspec.core.url_to_fs(uri, **dict(storage_options or {}))
        except (ImportError, ValueError) as exc:
            scheme = uri.split("://", 1)[0]
            raise ValueError(
                f"{uri}: cannot read {scheme}:// from Python ({exc}); install fsspec's implementation of {scheme} "
                "(s3fs, adlfs, gcsfs) next to lakestream, and give its credentials as storage_options in the settings"
            ) from None
        self.local = isinstance(self.fs, LocalFileSystem)
        self.root = self.root.rstrip("/") or "/"

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts]) if parts else self.root

    def isdir(self, *parts: str) -> bool:
        try:
            return bool(self.fs.isdir(self.path(*parts)))
        except OSError:
            return False

    def exists(self, *parts: str) -> bool:
        try:
            return bool(self.fs.exists(self.path(*parts)))
        except OSError:
            return False

    def entries(self, *parts: str) -> list[dict]:
        """The folder's entries (fsspec detail dicts), [] when it is missing."""
        path = self.path(*parts)
        self.fs.invalidate_cache(path)  # (object stores' listings are cached: a lease must see the store as it is)
        try:
            return list(self.fs.ls(path, detail=True))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def names(self, *parts: str) -> list[str]:
        return [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in self.entries(*parts)]

    def read_text(self, *parts: str) -> str:
        return self.fs.cat_file(self.path(*parts)).decode("utf-8")

    def create(self, rel: str, data: bytes) -> bool:
        """Write a new file, atomically and only if none of that name exists; False when one does."""
        path = self.path(rel)
        if self.local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{os.getpid()}"
            with open(tmp, "wb") as out:
                out.write(data)
            try:  # a hard link fails if the name exists: the file appears whole, or not at all
                os.link(tmp, path)
                return True
            except FileExistsError:
                return False
            finally:
                os.remove(tmp)
        try:
            with self.fs.open(path, "xb") as out:
                out.write(data)
            return True
        except FileExistsError:
            return False

    def write(self, rel: str, data: bytes) -> None:
        """Write a file whole, replacing what was there."""
        path = self.path(rel)
        if self.local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = path + ".tmp-" + str(os.getpid())
            with open(tmp, "wb") as out:
                out.write(data)
            os.replace(tmp, path)
            return
        self.fs.pipe_file(path, data)

    def delete(self, rel: str) -> None:
        try:
            self.fs.rm_file(self.path(rel))
        except FileNotFoundError:
            pass

    def mtime_ms(self, *parts: str) -> int | None:
        return _mtime_ms(self.fs.info(self.path(*parts)))

    def bytes_below(self, *parts: str) -> int:
        try:
            return int(self.fs.du(self.path(*parts), total=True)) if self.isdir(*parts) else 0
        except OSError:
            return 0

    def key(self, name: str) -> str:
        """How a listed file is named for comparison with the paths of Spark's source log (see file_key)."""
        return os.path.realpath(name) if self.local else name.lstrip("/")


def _mtime_ms(info: Mapping[str, Any]) -> int | None:
    """Modification time of an fsspec entry: local ``mtime``, S3 ``LastModified``, ABFS ``last_modified``,
    GCS ``updated``, memory ``created``."""
    for name in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(name)
        if value is None:
            continue
        if isinstance(value, (int, float)):
            return int(value * 1000)
        if isinstance(value, str):
            try:
                value = datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
        if isinstance(value, datetime):
            if value.tzinfo is None:
                value = value.replace(tzinfo=timezone.utc)
            return int(value.timestamp() * 1000)
    return None


def file_key(path_or_uri: str) -> str:
    """A file named in Spark's source log (``file:/...``, ``s3a://bucket/key``...) as Tree.key names it."""
    if "://" not in path_or_uri and not path_or_uri.startswith("file:"):
        return os.path.realpath(path_or_uri)
    scheme = path_or_uri.split(":", 1)[0]
    if scheme == "file":
        return os.path.realpath(unquote(urlparse(path_or_uri).path))
    try:
        stripped = fsspec.get_filesystem_class(scheme)._strip_protocol(path_or_uri)  # noqa: SLF001 - fsspec's own normaliser
    except (ImportError, ValueError):
        stripped = path_or_uri.split("://", 1)[1]
    return unquote(stripped).lstrip("/")


def landing_files(folder: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, tuple[int, int]]:
    """Visible files of a landing folder: key (see file_key) -> (bytes, mtime ms). ValueError if unreadable."""
    tree = Tree(folder, storage_options)
    found = {}
    for entry in tree.entries():
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if entry.get("type") == "file" and not name.startswith((".", "_")):
            # local files: the modification time in whole ms, as Java (and so Spark's source log) reads it
            mtime = os.stat(entry["name"]).st_mtime_ns // 1_000_000 if tree.local else _mtime_ms(entry) or 0
            found[tree.key(entry["name"])] = (int(entry.get("size") or 0), mtime)
    return found
