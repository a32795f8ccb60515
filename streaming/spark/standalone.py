"""A Spark standalone cluster on loopback, started from the pyspark package: a master and N
workers as separate JVMs, for trying a cluster setup on one machine (the bench and the cluster
test use it). Nothing here is needed to run on a real cluster: set ``spark.master`` instead."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spark_class() -> str:
    import pyspark

    return str(Path(pyspark.__file__).parent / "bin" / "spark-class")


@contextmanager
def standalone_cluster(workdir: Path, workers: int = 2, cores: int = 1, memory: str = "2g", timeout_s: float = 180):
    """Start a master and ``workers`` workers on 127.0.0.1, wait until every worker has registered
    (under load that takes well over 10 s), yield the master URL, and stop them all afterwards."""
    port, ui = _free_port(), _free_port()
    from .session import use_bundled_java

    use_bundled_java()  # a machine without Java runs the cluster on the virtualenv's JRE too
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_WORKER_DIR": str(workdir / "work")}
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    spark_class = _spark_class()
    master = f"spark://127.0.0.1:{port}"
    procs = [subprocess.Popen([spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", str(port), "--webui-port", str(ui)], env=env,
                              stdout=open(logs / "master.log", "w"), stderr=subprocess.STDOUT)]
    try:
        for i in range(workers):
            procs.append(subprocess.Popen(
                [spark_class, "org.apache.spark.deploy.worker.Worker", master, "--host", "127.0.0.1", "--cores", str(cores),
                 "--memory", memory, "--webui-port", str(_free_port())], env=env,
                stdout=open(logs / f"worker{i}.log", "w"), stderr=subprocess.STDOUT))
        deadline = time.time() + timeout_s
        while True:
            try:
                state = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=2).read())
                if sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE") >= workers:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"the standalone cluster did not register {workers} workers in {timeout_s:.0f} s; "
                                   f"see {logs}")
            time.sleep(1)
        yield master
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
