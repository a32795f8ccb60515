"""The Python workers' daemon (``streaming.spark.pyworkers``): workers whose import path holds no archive they do
not need, so PySpark's ``importlib.invalidate_caches()`` at the start of each task reads no archive again."""

from __future__ import annotations

import os
import zipfile

import pandas as pd


def _worker_path(batches):
    import importlib
    import sys

    import pyspark

    importlib.invalidate_caches()  # (as PySpark's worker does before each task)
    archives = [p for p in sys.path if p.endswith((".zip", ".jar")) and os.path.isfile(p)]
    cached = [p for p, finder in sys.path_importer_cache.items()
              if finder is not None and type(finder).__name__ == "zipimporter"]
    for _ in batches:
        pass
    yield pd.DataFrame({"archives": [";".join(archives)], "zip_finders": [";".join(cached)],
                        "pyspark": [pyspark.__file__]})


def test_python_tasks_run_in_workers_without_spark_archives_on_their_path(spark):
    assert spark.conf.get("spark.python.daemon.module") == "streaming.spark.pyworkers"
    rows = spark.range(4, numPartitions=2).mapInPandas(
        _worker_path, "archives string, zip_finders string, pyspark string").collect()
    assert len(rows) == 2
    for row in rows:
        assert ".jar" not in row.archives and "pyspark.zip" not in row.archives, row.archives
        assert "spark-core" not in row.zip_finders and "pyspark.zip" not in row.zip_finders, row.zip_finders
        assert ".zip" not in row.pyspark, f"PySpark imported from an archive: {row.pyspark}"


def test_the_zip_of_another_spark_distribution_and_foreign_archives_stay(tmp_path):
    """A Spark distribution's own PySpark zip (not the installed package's) is kept: the worker must speak the
    JVM's protocol. Spark's jars go (no Python module lives there); other archives stay."""
    from streaming.spark.pyworkers import trimmed

    site = tmp_path / "site-packages"
    (site / "pyspark" / "python" / "lib").mkdir(parents=True)
    (site / "pyspark" / "__init__.py").write_text("")
    (site / "py4j").mkdir()
    (site / "py4j" / "__init__.py").write_text("")
    dist = tmp_path / "opt-spark"
    (dist / "python" / "lib").mkdir(parents=True)
    (dist / "jars").mkdir()

    def archive(path):
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("x.py", "")
        return str(path)

    own_zip = archive(site / "pyspark" / "python" / "lib" / "pyspark.zip")
    own_py4j = archive(site / "pyspark" / "python" / "lib" / "py4j-0.10.9.7-src.zip")
    other_zip = archive(dist / "python" / "lib" / "pyspark.zip")
    jar = archive(dist / "jars" / "spark-core_2.12-3.5.7.jar")
    user = archive(tmp_path / "deps.zip")
    missing = str(tmp_path / "python311.zip")

    assert trimmed([own_zip, own_py4j, jar, user, missing, str(site)]) == [user, missing, str(site)]
    assert trimmed([other_zip, jar, user, str(site)]) == [other_zip, user, str(site)]
    assert trimmed([own_zip, own_py4j, jar, user]) == [own_zip, own_py4j, user], "no PySpark elsewhere: the zips stay"


_PREPARED = r"""
import gc, zipimport
import pandas as pd
from streaming.checkpoint.seen import lookup
{call}
print(gc.get_freeze_count(), zipimport.zipimporter.invalidate_caches.__name__)
"""


def _prepared_after(call: str, tmp_path) -> tuple[int, str]:
    """Run ``call`` in a fresh interpreter, as a worker would, and return its frozen objects and zip hook."""
    import subprocess
    import sys

    script = tmp_path / "worker.py"
    script.write_text(_PREPARED.format(call=call))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True, env=env).stdout.split()
    return int(out[0]), out[1]


def test_the_lookup_of_remembered_ids_keeps_the_workers_heap_out_of_each_tasks_collection(tmp_path):
    """PySpark's worker runs ``gc.collect()`` after every task: with the lookup's heap (pandas, pyarrow) in sight
    that was 54 % of the Python workers' time in a windowed latency run. The lookup freezes its worker's heap."""
    frozen, hook = _prepared_after("", tmp_path)
    assert frozen == 0 and hook == "invalidate_caches"  # (the oracle: an interpreter that ran nothing)
    batch = "pd.DataFrame({'_h1': [1, 2], '_h2': [3, 4]})"
    frozen, hook = _prepared_after(f"list(lookup('/nowhere', [], 0, {{}})(iter([{batch}])))", tmp_path)
    assert frozen > 10_000, frozen
    assert hook == "_keep_directory"


def _worker_socket(batches):
    import socket

    nodelay = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                try:
                    s.getpeername()  # (connected: the JVM's end, not a listener)
                except OSError:
                    continue
                nodelay.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        finally:
            s.close()
    n = sum(len(b) for b in batches)
    yield pd.DataFrame({"rows": [n], "nodelay": [",".join(map(str, nodelay))]})


def test_python_tasks_run_in_the_daemons_worker_that_sends_and_acknowledges_at_once(spark):
    """The JVM's write of a task's function and data waited on the worker's delayed acknowledgement of its header
    (40 ms for a task with little data, both sides idle: ``pyworkers``). The daemon's own ``worker`` runs every task: its
    socket to the JVM has Nagle's algorithm off, and every row still arrives (several tasks per worker, reused)."""
    if not os.path.isdir("/proc/self/fd"):
        import pytest

        pytest.skip("needs /proc to find the worker's sockets")
    for _ in range(3):  # (workers are reused from task to task)
        rows = spark.range(0, 30_000, 1, 2).mapInPandas(_worker_socket, "rows long, nodelay string").collect()
        assert sum(r.rows for r in rows) == 30_000
        for r in rows:
            assert r.nodelay and set(r.nodelay.split(",")) == {"1"}, r.nodelay


def _fails(batches):
    for b in batches:
        if len(b):
            raise ValueError("a function that fails in its worker")
    yield pd.DataFrame({"id": []})


def test_a_failing_python_task_reports_its_error_and_the_next_task_runs(spark):
    import pytest
    from pyspark.errors import PythonException

    with pytest.raises(PythonException, match="a function that fails in its worker"):
        spark.range(10, numPartitions=1).mapInPandas(_fails, "id long").collect()
    assert spark.range(1000, numPartitions=2).mapInPandas(lambda bs: (b for b in bs), "id long").count() == 1000


def test_the_acknowledging_reader_returns_every_byte_and_leaves_the_socket_open():
    """A reader over a real TCP connection, written in pieces of many sizes (the JVM's header, then the rest):
    the bytes read are the bytes sent, and closing the reader does not close the socket a reused worker reads
    its next task from."""
    import io
    import random
    import socket
    import threading

    from streaming.spark.pyworkers import Acknowledging

    listener = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(listener.getsockname())
    receiver, _ = listener.accept()
    rng = random.Random(7)
    pieces = [rng.randbytes(rng.choice([1, 7, 2769, 30_242, 70_000, 300_000])) for _ in range(40)]
    sent = b"".join(pieces)
    writer = threading.Thread(target=lambda: [sender.sendall(p) for p in pieces])
    writer.start()
    reader = io.BufferedReader(Acknowledging(receiver), 65536)
    got = bytearray()
    while len(got) < len(sent):
        got += reader.read(min(len(sent) - len(got), rng.choice([4, 8, 1000, 65536, 200_000])))
    writer.join()
    assert bytes(got) == sent
    reader.close()
    sender.sendall(b"next task")
    assert receiver.recv(100) == b"next task"
    for s in (sender, receiver, listener):
        s.close()


_SETTLED = r"""
import gc, weakref
from streaming.spark import pyworkers

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a

settled_before = gc.get_freeze_count()
pyworkers.settle_heap()  # (a worker that ran no lakestream function: PySpark's collection as it was)
untouched = gc.get_freeze_count() == settled_before
pyworkers.freeze_heap()
kept = [Node() for _ in range(5_000)]  # (what a worker keeps between tasks: a bucket's state, a view of its files)
dead = weakref.ref(cycle())  # (a cycle the task left behind)
before = gc.get_freeze_count()
pyworkers.settle_heap()
young_cycle_collected = dead() is None
kept_frozen = gc.get_freeze_count() >= before + 5_000
old = cycle()  # (a cycle that outlives its task, frozen with the survivors, and dies later)
old_ref = weakref.ref(old)
pyworkers.settle_heap()
frozen_cycle_alive = old_ref() is not None
del old
for _ in range(pyworkers.FULL_COLLECTION_EVERY):
    pyworkers.settle_heap()
print(untouched, young_cycle_collected, kept_frozen, frozen_cycle_alive, old_ref() is None, gc.get_count()[2])
"""


def test_what_a_worker_keeps_between_tasks_is_out_of_each_tasks_collection_and_cycles_still_go(tmp_path):
    """After a task, the worker collects the task's young objects and freezes the survivors, so that PySpark's full
    collection walks nothing (it walked every object a keyed worker kept: 37 % of the workers' samples over 1,000
    cards of 3,000 remembered ids each). A cycle the task left is collected at once; one that dies later goes with
    the full collection every ``FULL_COLLECTION_EVERY`` tasks."""
    import subprocess
    import sys

    script = tmp_path / "settle.py"
    script.write_text(_SETTLED)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True, env=env).stdout.split()
    untouched, young, kept, frozen_alive, reclaimed, _ = out
    assert untouched == "True", "a worker that never froze its heap keeps PySpark's collection"
    assert young == "True", "the task's own cycle is collected before the freeze"
    assert kept == "True", "what the worker keeps is frozen"
    assert frozen_alive == "True"  # (the oracle: frozen, a dead cycle waits for the full collection)
    assert reclaimed == "True", "the periodic full collection reclaims a frozen cycle that died"
