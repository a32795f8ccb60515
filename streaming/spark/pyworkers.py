"""The Python workers' daemon (``spark.python.daemon.module``): PySpark's own, started with a shorter import path.

Spark puts ``$SPARK_HOME/python/lib/pyspark.zip``, py4j's zip and the spark-core jar at the head of every Python
worker's path. PySpark's worker calls ``importlib.invalidate_caches()`` at the start of every task, and on Python
3.11 that reads the directory of every archive on the path again: 67 ms of CPU per task on this machine, most of
it the spark-core jar's 5,000 entries. A micro-batch runs several Python tasks (the lookup of remembered ids, the
keyed function), so that was a fixed cost of every batch.

This daemon drops, before anything is imported from them, the archives the workers do not need: Spark's jars
(no Python module lives there) and PySpark's and py4j's zips when the same PySpark is installed as a directory
(a PySpark installed with pip ships both: ``$SPARK_HOME`` is the installed package). Then it runs PySpark's daemon,
whose workers it forks inherit the path. A Spark distribution whose PySpark exists only as the zip keeps it.

It also acknowledges what the JVM sends at once (:func:`worker`). For each Python task the JVM writes a short
header, flushes it, then writes the rest (the function, the data) on a socket without ``TCP_NODELAY``: Nagle's
algorithm holds the rest until the header is acknowledged, and the worker's kernel delays that acknowledgement by
40 ms (Linux's minimum), since the worker has nothing to send back yet. So a task with little data waited 40 ms
with both sides idle: the lookup of remembered ids, in every batch of a windowed stream (a keyed function's tasks,
with more data than a segment, which Nagle does not hold, waited less). Spark 3.5 offers no setting for it (Spark 4
can use Unix sockets instead).

Every function lakestream runs in the workers (``mapInPandas``, ``applyInPandas``, pandas UDFs) calls
:func:`prepare` first, for what the daemon cannot do before a worker has loaded its modules.
"""

from __future__ import annotations

import gc
import importlib.machinery
import io
import os
import signal
import socket
import sys
import zipimport


def prepare() -> None:
    """Once per worker (a worker is reused task after task), at the top of a function Spark runs in it."""
    keep_zip_directories()
    freeze_heap()


def keep_zip_directories() -> None:
    """Where the daemon could not drop an archive (a PySpark that exists only as its zip, or a worker not forked
    by this daemon), its directory is kept instead of read again before every task: the archives do not change
    while a worker runs."""
    zipimport.zipimporter.invalidate_caches = _keep_directory


def _keep_directory(self) -> None:
    return None


def freeze_heap() -> None:
    """Move what the worker has loaded (pyspark, pandas, pyarrow, the job) out of the garbage collector's sight.
    PySpark's worker runs a full ``gc.collect()`` after every task, and each one walked that whole heap: 40 % of
    the Python workers' samples in a keyed latency run, 54 % in a windowed one (the lookup of remembered ids,
    ~70 ms of CPU per batch at 5k events/s). Frozen objects are still freed when their last reference goes;
    only cycles among them would stay."""
    if getattr(gc, "_lakestream_frozen", False):
        return
    gc.freeze()
    gc._lakestream_frozen = True


def _archive(entry: str) -> bool:
    return entry.endswith((".zip", ".jar")) and os.path.isfile(entry)


def trimmed(path: list[str]) -> list[str]:
    """``path`` without the archives a Python worker does not need (see the module)."""
    plain = [p for p in path if not _archive(p)]
    dropped = {p for p in path if p.endswith(".jar") and _archive(p)}
    for name in ("pyspark", "py4j"):
        spec = importlib.machinery.PathFinder.find_spec(name, plain)
        if spec is None or not spec.submodule_search_locations:
            continue
        home = os.path.dirname(os.path.realpath(spec.submodule_search_locations[0]))
        # the zip of the same installation: ``<site-packages>/pyspark/python/lib/<name>*.zip``
        dropped |= {p for p in path if _archive(p) and os.path.basename(p).startswith(name)
                    and os.path.realpath(p).startswith(home + os.sep)}
    return [p for p in path if p not in dropped]


class Acknowledging(io.RawIOBase):
    """The reading side of a worker's socket that acknowledges each read at once (``TCP_QUICKACK``: sends an
    acknowledgement the kernel was holding back, which releases the JVM's next write). Closing it leaves the socket
    open: a reused worker reads its next task from it."""

    def __init__(self, sock: socket.socket):
        super().__init__()
        self.sock = sock

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.sock.fileno()

    def readinto(self, buffer) -> int:
        n = self.sock.recv_into(buffer)
        quick_ack(self.sock)
        return n


_QUICKACK = getattr(socket, "TCP_QUICKACK", None)  # (Linux's; elsewhere reads acknowledge as the system does)


def quick_ack(sock: socket.socket) -> None:
    if _QUICKACK is None:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)
    except OSError:  # (not a TCP socket)
        pass


def worker(sock: socket.socket, authenticated: bool) -> int:
    """One task in a forked worker: PySpark's ``daemon.worker`` (Spark 3.5), with the socket read through
    :class:`Acknowledging` and written without Nagle's delay (the worker writes its results in one flush)."""
    from pyspark.daemon import compute_real_exit_code
    from pyspark.serializers import UTF8Deserializer, write_with_length
    from pyspark.worker import main as worker_main

    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (a stack trace on SIGINT, for debugging)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass
    buffer_size = int(os.environ.get("SPARK_BUFFER_SIZE", 65536))
    infile = io.BufferedReader(Acknowledging(sock), buffer_size)
    outfile = os.fdopen(os.dup(sock.fileno()), "wb", buffer_size)
    if not authenticated:
        secret = UTF8Deserializer().loads(infile)
        ok = os.environ["PYTHON_WORKER_FACTORY_SECRET"] == secret
        write_with_length(b"ok" if ok else b"err", outfile)
        outfile.flush()
        if not ok:
            sock.close()
            return 1
    code = 0
    try:
        worker_main(infile, outfile)
    except SystemExit as exc:
        code = compute_real_exit_code(exc.code)
    finally:
        try:
            outfile.flush()
        except Exception:
            pass
        settle_heap()
    return code


# Every this many tasks a worker's whole heap is collected (see :func:`settle_heap`).
FULL_COLLECTION_EVERY = 64
_tasks = 0


def settle_heap() -> None:
    """After a task, before PySpark's full ``gc.collect()``: collect the young generations (the task's own objects:
    a cycle it left is reclaimed here), then freeze what survived, so that PySpark's collection walks nothing. What a
    worker keeps between tasks (a keyed bucket's state, a view of its files) grows with the state, and each full
    collection walked all of it: 37 % of the workers' samples in a keyed run over 1,000 cards of 3,000 remembered ids
    each (bench/HISTORY.md, 2026-12-04). A cycle that outlives its task and dies later is reclaimed by a full
    collection every ``FULL_COLLECTION_EVERY`` tasks. Only for a worker whose heap :func:`freeze_heap` froze (one that
    ran a lakestream function)."""
    global _tasks
    if not getattr(gc, "_lakestream_frozen", False):
        return
    _tasks += 1
    if _tasks % FULL_COLLECTION_EVERY == 0:
        gc.unfreeze()
        gc.collect()
    else:
        gc.collect(1)
    gc.freeze()


def main() -> None:
    kept = trimmed(sys.path)
    for entry in set(sys.path) - set(kept):
        sys.path_importer_cache.pop(entry, None)
    sys.path[:] = kept
    import pyspark
    import pyspark.daemon

    if pyspark.__version__.startswith("3.5."):  # (:func:`worker` is Spark 3.5's; another version keeps its own)
        pyspark.daemon.worker = worker  # (the manager forks and calls ``worker`` by its module's name)
    pyspark.daemon.manager()


if __name__ == "__main__":
    main()
