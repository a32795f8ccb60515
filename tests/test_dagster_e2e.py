"""End to end with real processes on loopback: a temporary DAGSTER_HOME, a code server, ``dagster-webserver`` and
``dagster-daemon`` started here, driven through the GraphQL API the UI uses, and the UI itself in
headless Chromium. Each run the code server launches is a real subprocess with its own Spark.

Flow: launch the purchase_metrics stream (continuous) -> per-batch materializations appear ->
terminate the run from the API -> the query stopped after its batch (no batch in flight) -> launch
a partition backfill -> the partition is materialized by the bounded twin and its reconciliation
check recorded -> the browser finds the lineage landing -> purchase_metrics -> a dbt mart.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from streaming.checkpoint.inspect import inspect_checkpoint
from tests.conftest import SMALL

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
LOCATION = "orchestration.definitions"
DAY = SMALL.start.strftime("%Y-%m-%d")
MAIN = ["lake", "payments", "purchase_metrics"]


def _assert_exactly_once(lake: Path) -> None:
    """Each window of the stream's table once, and each its events (plain Python over the landing files)
    less those the late table says missed it."""
    from collections import Counter

    from pyiceberg.table import StaticTable

    from tests import oracle

    def read(table: str):
        metadata = lake / "warehouse" / "payments" / table / "metadata"
        version = (metadata / "version-hint.text").read_text().strip()
        return StaticTable.from_metadata(str(metadata / f"v{version}.metadata.json")).scan().to_pandas()

    windows, late = read("purchase_metrics"), read("purchase_metrics_late")
    keys = Counter((r.user_id, int(r.window_start.timestamp() * 1000)) for r in windows.itertuples())
    assert keys and max(keys.values()) == 1, [k for k, n in keys.items() if n > 1][:5]
    missed = Counter((r.user_id, int(r.window_start.timestamp() * 1000)) for r in late.itertuples())
    truth = oracle.bounded_windows(lake / "landing" / "payments")
    counts = {(r.user_id, r.window_start_ms): r.event_count for r in truth.itertuples()}
    wrong = {k: (r.event_count, missed[k], counts.get(k)) for r in windows.itertuples()
             if (k := (r.user_id, int(r.window_start.timestamp() * 1000))) and r.event_count + missed[k] != counts.get(k)}
    assert not wrong, list(wrong.items())[:5]


def _parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _with_descendants(pids: list[int]) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(_parent_of(int(stat.parent.name)), []).append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    out, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.append(pid)
            todo += children.get(pid, [])
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Servers:
    def __init__(self, root: Path, postgres_url: str | None = None):
        self.root = root
        self.postgres_url = postgres_url
        self.port = _free_port()
        self.dagster_home = root / "dagster"
        self.lake = root / "lake"
        self.procs: list[subprocess.Popen] = []

    def gql(self, query: str, variables: dict | None = None) -> dict:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/graphql", headers={"Content-Type": "application/json"},
            data=json.dumps({"query": query, "variables": variables or {}}).encode())
        try:
            result = json.loads(urllib.request.urlopen(request, timeout=60).read())
        except urllib.error.HTTPError as e:  # (the server's own words, not only its status)
            raise AssertionError(f"{e}: {e.read().decode(errors='replace')[:4000]}") from None
        assert "errors" not in result, result["errors"]
        return result["data"]

    def start(self) -> None:
        from orchestration.record import ensure_dagster_yaml

        ensure_dagster_yaml(str(self.dagster_home), self.postgres_url)  # as `make ui` does (or a deployment)
        # The code location in a server of its own, which the webserver and the daemon connect to (as `dagster dev`
        # and a deployment run it: docs/dagster.md). A `python_module` entry would make the daemon start a new
        # process for it every minute, each importing the definitions again (~5-8 s of CPU here).
        code_port = _free_port()
        (self.root / "workspace.yaml").write_text(
            f"load_from:\n  - grpc_server:\n      host: 127.0.0.1\n      port: {code_port}\n"
            f"      location_name: {LOCATION}\n")
        env = {**os.environ, "DAGSTER_HOME": str(self.dagster_home), "LAKESTREAM_HOME": str(self.lake),
               "PYSPARK_PYTHON": sys.executable}
        bin_dir = Path(sys.executable).parent
        code_server = [str(bin_dir / "dagster"), "code-server", "start", "-h", "127.0.0.1", "-p", str(code_port),
                       "-m", LOCATION, "-d", str(REPO), "--location-name", LOCATION]
        self._start(code_server, "code-server.log", env)
        health = [str(bin_dir / "dagster"), "api", "grpc-health-check", "-h", "127.0.0.1", "-p", str(code_port)]
        deadline = time.monotonic() + 180
        while subprocess.run(health, capture_output=True, env=env).returncode != 0:
            assert self.procs[-1].poll() is None, (self.root / "code-server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, (self.root / "code-server.log").read_text()[-2000:]
            time.sleep(1)
        self._start([str(bin_dir / "dagster-webserver"), "-h", "127.0.0.1", "-p", str(self.port), "-w",
                     str(self.root / "workspace.yaml")], "webserver.log", env)
        self._start([str(bin_dir / "dagster-daemon"), "run", "-w", str(self.root / "workspace.yaml")], "daemon.log", env)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                entries = self.gql("{ workspaceOrError { ... on Workspace { locationEntries { loadStatus "
                                   "locationOrLoadError { __typename ... on PythonError { message } } } } } }")
                entry = entries["workspaceOrError"]["locationEntries"][0]
                if entry["loadStatus"] == "LOADED":
                    assert entry["locationOrLoadError"]["__typename"] == "RepositoryLocation", entry
                    return
            except (OSError, KeyError, IndexError):
                pass
            time.sleep(1)
        raise AssertionError(f"the webserver did not load {LOCATION}: {(self.root / 'webserver.log').read_text()[-2000:]}")

    def _start(self, cmd: list[str], log: str, env: dict) -> None:
        self.procs.append(subprocess.Popen(cmd, cwd=self.root, env=env, stdout=open(self.root / log, "w"),
                                           stderr=subprocess.STDOUT, start_new_session=True))

    def stop(self) -> None:
        for proc in self.procs:  # SIGINT to the whole process group, then SIGKILL after a timeout
            try:
                os.killpg(proc.pid, signal.SIGINT)
            except ProcessLookupError:
                continue
        deadline = time.monotonic() + 30
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)

    def leftovers(self, timeout_s: float = 20) -> list[int]:
        """Process groups of the servers that still have a member (after killed members are reaped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = []
            for proc in self.procs:
                try:
                    os.killpg(proc.pid, 0)
                    alive.append(proc.pid)
                except ProcessLookupError:
                    pass
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.5)

    def wait_run(self, run_id: str, done=("SUCCESS", "FAILURE", "CANCELED"), timeout=300) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.gql("query($id: ID!) { runOrError(runId: $id) { ... on Run { status } } }",
                              {"id": run_id})["runOrError"]["status"]
            if status in done:
                return status
            time.sleep(1)
        raise AssertionError(f"run {run_id} still {status} after {timeout}s; its last events:\n{self.run_log(run_id)}")

    def launch_stream(self, config: dict) -> dict:
        """Launch purchase_metrics_stream with the op's ``config``, as the launchpad does; the answer."""
        return self.gql(
            "mutation($p: ExecutionParams!) { launchRun(executionParams: $p) { __typename "
            "... on LaunchRunSuccess { run { runId } } ... on PythonError { message } "
            "... on RunConfigValidationInvalid { errors { message } } } }",
            {"p": {"selector": {"repositoryLocationName": LOCATION, "repositoryName": "__repository__",
                                "jobName": "purchase_metrics_stream"},
                   "runConfigData": {"ops": {"purchase_metrics": {"config": config}}}}})["launchRun"]

    def wait_restart(self, run_id: str, timeout: float) -> str:
        """The run the stream supervisor started in place of ``run_id``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            runs = self.gql('{ runsOrError(filter: {tags: [{key: "lakestream/restart-of", value: "%s"}]}) '
                            "{ ... on Runs { results { runId status } } } }" % run_id)["runsOrError"]["results"]
            if runs:
                return runs[0]["runId"]
            time.sleep(2)
        raise AssertionError(f"no restart of {run_id} after {timeout}s:\n{(self.root / 'daemon.log').read_text()[-2000:]}")

    def current_run(self, run_id: str, savepoint: str, timeout: float) -> str:
        """The stream's run now: the last of the supervisor's restarts that follow ``run_id``, once it runs from
        ``savepoint`` (a savepoint id) and has not ended."""
        deadline, current = time.monotonic() + timeout, run_id
        while time.monotonic() < deadline:
            runs = self.gql('{ runsOrError(filter: {tags: [{key: "lakestream/restart-of", value: "%s"}]}) '
                            "{ ... on Runs { results { runId } } } }" % current)["runsOrError"]["results"]
            if runs:
                current = runs[0]["runId"]
                continue
            run = self.gql("query($id: ID!) { runOrError(runId: $id) { ... on Run { status runConfigYaml } } }",
                           {"id": current})["runOrError"]
            if savepoint in run["runConfigYaml"] and run["status"] in ("QUEUED", "NOT_STARTED", "STARTING", "STARTED"):
                return current
            time.sleep(2)
        raise AssertionError(f"no running restart of {run_id} from savepoint {savepoint} (last {current}) after "
                             f"{timeout}s:\n{(self.root / 'daemon.log').read_text()[-2000:]}")

    def savepoint_runs(self) -> list[dict]:
        """Every run of savepoint_before_deploy so far (run id and tags)."""
        return self.gql('{ runsOrError(filter: {pipelineName: "savepoint_before_deploy"}) { ... on Runs { '
                        "results { runId tags { key value } } } } }")["runsOrError"]["results"]

    def schedule_ticks(self, selector: dict, timeout: float = 180) -> list[dict]:
        """The schedule's ticks (scheduled time, status, runs launched), once none is in progress."""
        deadline = time.monotonic() + timeout
        while True:
            ticks = self.gql("query($s: ScheduleSelector!) { scheduleOrError(scheduleSelector: $s) { ... on Schedule { "
                             "scheduleState { ticks(limit: 20) { timestamp status runIds } } } } }",
                             selector)["scheduleOrError"]["scheduleState"]["ticks"]
            if all(t["status"] != "STARTED" for t in ticks) or time.monotonic() > deadline:
                return ticks
            time.sleep(2)

    def run_log(self, run_id: str, last: int = 30) -> str:
        events = self.gql("query($id: ID!) { logsForRun(runId: $id) { ... on EventConnection { events { "
                          "__typename ... on MessageEvent { message timestamp } } } } }", {"id": run_id})
        lines = [f"{e.get('timestamp')} {e['__typename']}: {e.get('message', '')[:300]}"
                 for e in events["logsForRun"]["events"]]
        return "\n".join(lines[-last:])

    def backfill(self, days: list[str], force: bool, timeout: float = 420) -> dict:
        """A partition backfill of purchase_metrics' tables, as the UI launches it; its final state."""
        launched = self.gql(
            "mutation($p: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $p) { __typename "
            "... on LaunchBackfillSuccess { backfillId } ... on PythonError { message } } }",
            {"p": {"partitionNames": days, "assetSelection": [{"path": MAIN}, {"path": MAIN[:-1] + ["purchase_metrics_late"]}],
                   "runConfigData": {"ops": {"purchase_metrics_bounded": {"config": {"force": force}}}}}})
        backfill_id = launched["launchPartitionBackfill"]["backfillId"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.gql("query($id: String!) { partitionBackfillOrError(backfillId: $id) { ... on PartitionBackfill "
                             "{ status runs(limit: 5) { runId status } } } }", {"id": backfill_id})["partitionBackfillOrError"]
            if state["status"] not in ("REQUESTED",):
                return state
            time.sleep(3)
        raise AssertionError(f"backfill {backfill_id} still running after {timeout}s: {state}")

    def materializations(self, key: list[str]) -> list[dict]:
        data = self.gql("query($k: AssetKeyInput!) { assetOrError(assetKey: $k) { ... on Asset { "
                        "assetMaterializations(limit: 200) { runId partition metadataEntries { label } } } } }",
                        {"k": {"path": key}})
        return data["assetOrError"]["assetMaterializations"]


def _servers(root: Path, postgres_url: str | None = None):
    from lakestream.generator import generate

    servers = Servers(root, postgres_url)
    generate(SMALL, servers.lake / "landing", sources=("payments",))
    (servers.lake / "lakestream.yaml").write_text(
        "spark: {shuffle_partitions: 2}\njobs: {purchase_metrics: {max_files_per_trigger: 3, trigger_interval: 1s}}\n"
        "savepoint_schedule: '* * * * *'\n")  # (the schedule is off until a test starts it)
    servers.start()
    yield servers
    servers.stop()
    assert servers.leftovers() == [], "a server process (or one of its children) outlived the stop"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The embedded default: SQLite storage under DAGSTER_HOME (`make ui`)."""
    yield from _servers(tmp_path_factory.mktemp("e2e"))


def _postgres_bin() -> Path | None:
    import glob

    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


@pytest.fixture(scope="module")
def postgres_url():
    """A PostgreSQL server of the test's own, from the machine's binaries (Debian's postgresql): initdb in a
    temporary folder, its own port on loopback; stopped at the end. None without the binaries."""
    import pwd
    import tempfile

    binaries = _postgres_bin()
    if binaries is None:
        yield None
        return
    root = Path(tempfile.mkdtemp(prefix="lakestream-pg-"))
    as_user: list[str] = []
    if os.getuid() == 0:  # initdb refuses root: the server runs as the postgres system user
        account = pwd.getpwnam("postgres")
        os.chown(root, account.pw_uid, account.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    port = _free_port()
    data = root / "data"

    def pg(*args: str) -> None:
        done = subprocess.run([*as_user, *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (args, done.stdout, done.stderr)

    pg(str(binaries / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
    pg(str(binaries / "pg_ctl"), "-D", str(data), "-l", str(root / "server.log"), "-w", "-o",
       f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
    try:
        pg(str(binaries / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "dagster")
        yield f"postgresql://postgres@127.0.0.1:{port}/dagster"
    finally:
        pg(str(binaries / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def deployed(tmp_path_factory, postgres_url, servers):
    """Dagster as deployed: run, event-log and schedule storage in PostgreSQL, a webserver and a daemon as
    separate processes (the SQLite servers where the machine has no PostgreSQL binaries)."""
    if postgres_url is None:
        yield servers
        return
    yield from _servers(tmp_path_factory.mktemp("e2e-postgres"), postgres_url)


def test_the_instance_config_the_mode_choice_and_a_run_outside_dagster(servers):
    # `make ui`'s dagster.yaml is read: no warning about a missing instance configuration
    assert "dagster.yaml" in os.listdir(servers.dagster_home)
    assert "No dagster instance configuration file" not in (servers.root / "webserver.log").read_text()
    # mode is a choice: a typo is refused by the launchpad's validation, before any run starts
    refused = servers.launch_stream({"mode": "continous"})
    assert refused["__typename"] == "RunConfigValidationInvalid", refused
    # so is a duration that is not a number of seconds (a text such as '5 sec' could only fail the run)
    refused = servers.launch_stream({"trigger_interval_seconds": "5 sec"})
    assert refused["__typename"] == "RunConfigValidationInvalid", refused
    assert "trigger_interval_seconds" in json.dumps(refused["errors"]), refused
    # a run from a shell (`make demo`) recorded in this instance shows on the table in the UI's API
    env = {**os.environ, "DAGSTER_HOME": str(servers.dagster_home), "LAKESTREAM_HOME": str(servers.lake)}
    code = ("from orchestration.record import record_outside_run, record_tables_created; "
            "from streaming.project import get_job, registry; "
            f"print(record_outside_run(get_job('purchase_metrics'), ['{DAY}'], what='lakestream demo', "
            "metadata={'lines': 1})); print(record_tables_created(list(registry().values()), what='lakestream demo'))")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    late = servers.materializations(MAIN[:-1] + ["purchase_metrics_late"])
    assert any(m["partition"] == DAY and not m["runId"] for m in late), late
    # the tables the demo created are not "never materialized": materializing a mart asks the UI's question
    # (a materializable upstream asset without a materialization) and finds none
    marts = servers.gql('{ assetNodes { assetKey { path } dependencyKeys { path } } }')["assetNodes"]
    upstream = {tuple(d["path"]) for n in marts if n["assetKey"]["path"][:2] == ["lake", "marts"]
                for d in n["dependencyKeys"]}
    assert tuple(MAIN) in upstream and len(upstream) >= 6, upstream
    nodes = servers.gql("query($k: [AssetKeyInput!]) { assetNodes(assetKeys: $k) { assetKey { path } "
                        "isMaterializable assetMaterializations(limit: 1) { timestamp } } }",
                        {"k": [{"path": list(k)} for k in upstream]})["assetNodes"]
    assert len(nodes) == len(upstream)
    assert [n["assetKey"]["path"] for n in nodes if n["isMaterializable"] and not n["assetMaterializations"]] == []


def test_the_deployed_instance_keeps_its_storage_in_postgresql(deployed, postgres_url):
    if postgres_url is None:
        pytest.skip("no PostgreSQL binaries on this machine: the flow below ran on SQLite")
    text = (deployed.dagster_home / "dagster.yaml").read_text()
    assert "postgres_url: " + postgres_url in text and "lakestream/stream" in text
    assert not list(deployed.dagster_home.glob("**/*.db")), "no SQLite storage beside it"
    from dagster import DagsterInstance

    with DagsterInstance.from_config(str(deployed.dagster_home)) as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert instance.run_monitoring_enabled and instance.run_monitoring_start_timeout_seconds == 180


def test_launch_stream_see_batches_terminate_gracefully_then_backfill_a_partition(deployed):
    servers = deployed
    launched = servers.launch_stream({"mode": "continuous", "trigger_interval_seconds": 1, "materialize_every_seconds": 0})
    assert launched["__typename"] == "LaunchRunSuccess", launched
    run_id = launched["run"]["runId"]

    deadline = time.monotonic() + 300
    seen = []
    while time.monotonic() < deadline and len(seen) < 2:  # per-batch materializations appear while it runs
        seen = [m for m in servers.materializations(MAIN) if m["runId"] == run_id]
        time.sleep(2)
    assert len(seen) >= 2, (servers.root / "daemon.log").read_text()[-2000:]
    assert seen[0]["partition"] == DAY
    assert {"rows_written", "watermark_lag_s", "batch_seconds"} <= {e["label"] for e in seen[0]["metadataEntries"]}

    # A second launch of the running stream waits in the queue (the tag's limit in `make ui`'s dagster.yaml)
    again = servers.launch_stream({"mode": "continuous"})
    assert again["__typename"] == "LaunchRunSuccess", again
    second = again["run"]["runId"]
    for _ in range(8):  # the daemon dequeues every few seconds: it stays queued tick after tick
        time.sleep(2)
        state = servers.gql("query($id: ID!) { runOrError(runId: $id) { ... on Run { status tags { key value } } } }",
                            {"id": second})["runOrError"]
        assert state["status"] == "QUEUED", (state, servers.run_log(second))
    assert {"key": "lakestream/stream", "value": "purchase_metrics"} in state["tags"]
    servers.gql("mutation($id: String!) { terminateRun(runId: $id) { __typename } }", {"id": second})
    assert servers.wait_run(second, timeout=60) == "CANCELED"

    # The stream's processes die (its run worker, the streaming process and its JVM SIGKILLed at once): the run
    # is marked failed, saying why, and the supervisor starts it again as a crash; the table stays exactly-once.
    tags = {t["key"]: t["value"] for t in servers.gql(
        "query($id: ID!) { runOrError(runId: $id) { ... on Run { tags { key value } } } }", {"id": run_id})["runOrError"]["tags"]}
    streaming_pid = int(tags["lakestream/process"].split(":")[1])
    worker = re.search(r"Started process for run \(pid: (\d+)\)", servers.run_log(run_id, last=10_000))
    assert worker, servers.run_log(run_id)
    named = [int(worker.group(1)), streaming_pid]
    victims = _with_descendants(named)  # (the step runs under a forkserver)
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # a short-lived descendant (a Python worker of Spark's) that ended meanwhile
            assert pid not in named, f"process {pid} of the running stream was gone before the kill"
    killed = time.monotonic()
    assert servers.wait_run(run_id, timeout=240) == "FAILURE", servers.run_log(run_id)
    failure = servers.run_log(run_id, last=5)
    # (here the code server that launched the run worker says so; where nothing is left to, the supervisor does:
    # tests/test_dagster.py, a stream run whose process is gone)
    assert "terminated by signal 9" in failure or f"its process (pid {streaming_pid} on " in failure, failure
    landing = servers.lake / "landing" / "payments"  # input for the restarted stream: a file of events again, new ids
    again = sorted(landing.glob("*.jsonl"))[-1].read_text().replace('"event_id":"', '"event_id":"again-')
    (landing / "zz-after-the-kill.jsonl").write_text(again)
    restarted = servers.wait_restart(run_id, timeout=240)
    while time.monotonic() < killed + 480 and "purchase_metrics batch" not in servers.run_log(restarted, last=200):
        time.sleep(2)
    print(f"killed -> failed and restarted -> a batch in {time.monotonic() - killed:.0f}s")
    assert "purchase_metrics batch" in servers.run_log(restarted, last=200), servers.run_log(restarted)
    first_run, run_id = run_id, restarted

    # The savepoint schedule, started: at its tick (each minute here, from the settings) the daemon launches
    # savepoint_before_deploy, which stops the stream with a savepoint; the supervisor resumes it from there.
    selector = {"s": {"repositoryLocationName": LOCATION, "repositoryName": "__repository__",
                      "scheduleName": "savepoint_before_deploy_schedule"}}
    started = servers.gql("mutation($s: ScheduleSelector!) { startSchedule(scheduleSelector: $s) { __typename "
                          "... on PythonError { message } } }", selector)["startSchedule"]
    assert started["__typename"] == "ScheduleStateResult", started
    deadline, ticked = time.monotonic() + 150, []
    while time.monotonic() < deadline and not ticked:
        time.sleep(3)
        ticked = servers.savepoint_runs()
    assert ticked, (servers.root / "daemon.log").read_text()[-3000:]
    # Dagster 1.13's daemon ends the iteration that launched a new schedule's first run by writing the schedule's
    # state as it read it, running (``_write_and_get_next_checkpoint_timestamp`` in ``dagster/_scheduler/scheduler.py``):
    # a stop that lands before that write is undone, and the next tick launches a run (CI at 6880724: a tick a minute
    # after the stop). The stop comes once that iteration is over, as an operator's would, and is checked again below.
    servers.schedule_ticks(selector)
    time.sleep(5)
    # Stopped, and checked: a later tick would stop the stream again while the test terminates it (a reset
    # to the code's default did not stop the ticks of a schedule started from the UI: CI at 2e4b4db).
    state = servers.gql("query($s: ScheduleSelector!) { scheduleOrError(scheduleSelector: $s) { ... on Schedule { "
                        "scheduleState { id } } } }", selector)["scheduleOrError"]["scheduleState"]
    stopped = servers.gql("mutation($id: String!) { stopRunningSchedule(id: $id) { __typename ... on ScheduleStateResult "
                          "{ scheduleState { status } } ... on PythonError { message } } }", {"id": state["id"]})
    stopped_at = time.time()
    assert stopped["stopRunningSchedule"].get("scheduleState", {}).get("status") == "STOPPED", stopped
    assert {"key": "dagster/schedule_name", "value": "savepoint_before_deploy_schedule"} in ticked[0]["tags"]
    # What a stop promises: no tick after it launches a run. A tick due before it may still launch one after it: the
    # daemon a minute behind on two cores under the whole suite (CI at b9e0b67 saw the first tick's run and the next
    # tick's). Every run launched is waited for (the second finds the stream paused, or takes a second savepoint).
    assert servers.wait_run(ticked[0]["runId"], timeout=300) == "SUCCESS", servers.run_log(ticked[0]["runId"])
    ticks = servers.schedule_ticks(selector)
    launched = [t for t in sorted(ticks, key=lambda t: t["timestamp"]) if t["runIds"]]
    assert launched and all(t["timestamp"] <= stopped_at for t in ticks), (stopped_at, ticks)
    savepoint_runs = [run for t in launched for run in t["runIds"]]
    assert ticked[0]["runId"] in savepoint_runs, (ticked, ticks)
    if len(savepoint_runs) > 1:
        print(f"the daemon ran behind: ticks {[t['timestamp'] for t in launched]} launched runs, stopped at {stopped_at:.0f}")
    for run in savepoint_runs:
        assert servers.wait_run(run, timeout=300) == "SUCCESS", servers.run_log(run)
    # A tick due before the stop may also launch its run after the listing above (the daemon's iteration had read the
    # schedule as running before the stop: CI at 814ddee saw a run that no listed tick named). Until the daemon has had
    # 90 s past the stop, each savepoint run that appears must come from a tick due before the stop, and is waited for:
    # the stream followed below is the one resumed from the last savepoint.
    settled = stopped_at + 90
    while True:
        listed = {r["runId"] for r in servers.savepoint_runs()}
        late = sorted(listed - set(savepoint_runs))
        if late:
            ticks = servers.schedule_ticks(selector)
            tick_of = {run: t for t in ticks for run in t["runIds"]}
            for run in late:
                assert run in tick_of and tick_of[run]["timestamp"] <= stopped_at, (run, stopped_at, ticks)
                assert servers.wait_run(run, timeout=300) == "SUCCESS", servers.run_log(run)
            print(f"a tick before the stop launched its run late: {late}")
            savepoint_runs += late
        elif time.time() >= settled:
            break
        else:
            time.sleep(3)
    still = servers.gql("query($s: ScheduleSelector!) { scheduleOrError(scheduleSelector: $s) { ... on Schedule { "
                        "scheduleState { status } } } }", selector)["scheduleOrError"]["scheduleState"]["status"]
    assert still == "STOPPED", (still, servers.schedule_ticks(selector))
    assert "purchase_metrics: savepoint " in servers.run_log(savepoint_runs[0], last=200)
    taken = [tags["lakestream/savepoint.purchase_metrics"] for tags in (
        {t["key"]: t["value"] for t in servers.gql("query($id: ID!) { runOrError(runId: $id) { ... on Run { tags { key value } } } }",
                                                   {"id": run})["runOrError"]["tags"]} for run in savepoint_runs)
        if "lakestream/savepoint.purchase_metrics" in tags]
    assert taken, "no savepoint run recorded a savepoint of purchase_metrics"
    (landing / "zz-after-the-savepoint.jsonl").write_text(again.replace('"event_id":"again-', '"event_id":"resumed-'))
    resumed = servers.current_run(run_id, savepoint=taken[-1], timeout=240)
    reason = {t["key"]: t["value"] for t in servers.gql(
        "query($id: ID!) { runOrError(runId: $id) { ... on Run { tags { key value } } } }", {"id": resumed})["runOrError"]["tags"]}
    assert reason["lakestream/restart-reason"] == "savepoint", reason
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and "purchase_metrics batch" not in servers.run_log(resumed, last=200):
        time.sleep(2)
    assert "purchase_metrics batch" in servers.run_log(resumed, last=200), servers.run_log(resumed)
    run_id = resumed
    savepoints = servers.savepoint_runs()
    assert sorted(r["runId"] for r in savepoints) == sorted(savepoint_runs), "every savepoint run came from a tick before the stop"

    terminated = servers.gql("mutation($id: String!) { terminateRun(runId: $id, terminatePolicy: SAFE_TERMINATE) "
                             "{ __typename } }", {"id": run_id})["terminateRun"]
    assert terminated["__typename"] == "TerminateRunSuccess"
    asked = time.monotonic()
    assert servers.wait_run(run_id, timeout=180) == "CANCELED"
    log = servers.run_log(run_id, last=400)
    print(f"terminated in {time.monotonic() - asked:.1f}s\n{log[-3000:]}")
    assert "SIGINT received; stopped purchase_metrics after batch" in log, log  # taken as a stop request, not an exception
    steps = servers.gql("query($id: ID!) { runOrError(runId: $id) { ... on Run { stepStats { stepKey status } } } }",
                        {"id": run_id})["runOrError"]["stepStats"]
    assert steps and all(s["status"] == "SUCCESS" for s in steps), steps  # a clean stop is no failed step
    assert "DagsterExecutionInterruptedError" not in log, log
    report = inspect_checkpoint("purchase_metrics", str(servers.lake / "checkpoints" / "purchase_metrics"))
    assert report.last_committed_batch is not None and report.in_flight_batch is None, "stopped after its batch"
    _assert_exactly_once(servers.lake)  # across the kill, the restart and the stop (before any backfill replaces)
    from dagster import DagsterInstance

    from orchestration.streams import DesiredState

    with DagsterInstance.from_config(str(servers.dagster_home)) as instance:
        assert DesiredState(instance, "purchase_metrics").get()["state"] == "stopped"  # not restarted

    # The same day backfilled twice (a retry, a re-run; the UI test below does it twice more): each passes, each
    # evaluates the day's reconciliation in its own run (it used to fail on a UNIQUE constraint from the second on).
    runs = []
    for attempt in range(2):
        state = servers.backfill([DAY], force=True)  # the day is not final under the stream's watermark: force
        assert state["status"] == "COMPLETED_SUCCESS", (attempt, state, servers.run_log(state["runs"][0]["runId"]))
        runs.append(state["runs"][0]["runId"])
        assert any(m["runId"] == runs[-1] and m["partition"] == DAY for m in servers.materializations(MAIN))
    with DagsterInstance.from_config(str(servers.dagster_home)) as instance:
        from dagster import AssetCheckKey, AssetKey
        from dagster._core.event_api import PartitionKeyFilter

        records = instance.event_log_storage.get_asset_check_execution_history(
            AssetCheckKey(AssetKey(MAIN), "reconciliation"), limit=10, partition_filter=PartitionKeyFilter(key=DAY))
        assert {r.run_id for r in records} == set(runs), "one evaluation of the day per backfill run"
        for record in records:
            evaluation = record.event.dagster_event.event_specific_data
            assert evaluation.passed and evaluation.metadata["compared"].value > 0
            assert "before the replace" in evaluation.description  # never the bounded result against itself

    # Without force, the day of a stopped stream is backfilled all the same (only a running stream's is refused:
    # tests/test_backfill.py), and the run says why it may
    state = servers.backfill([DAY], force=False)
    assert state["status"] == "COMPLETED_SUCCESS", (state, servers.run_log(state["runs"][0]["runId"]))
    assert "its stream is stopped" in servers.run_log(state["runs"][0]["runId"], last=400)

    # The stream's run logged a line per batch; its figures are rounded; the stream asset plots them over time
    stream_log = servers.run_log(first_run, last=2000)
    assert "purchase_metrics batch 0:" in stream_log and "purchase_metrics batch 1:" in stream_log, stream_log[-2000:]
    with DagsterInstance.from_config(str(servers.dagster_home)) as instance:
        from dagster import AssetCheckKey, AssetKey

        stream_asset = AssetKey(["streams", "purchase_metrics"])
        observations = instance.fetch_observations(stream_asset, limit=50).records
        assert len(observations) >= 2
        meta = observations[0].event_log_entry.asset_observation.metadata
        assert meta["batch_seconds"].value == round(meta["batch_seconds"].value, 2) and meta["state_rows"].value > 0
        # the daemon's checkpoint_health sensor observed the landing folder on its own
        assert instance.fetch_observations(AssetKey(["landing", "payments"]), limit=1).records

    # Input waiting with no stream running (the normal state of on-demand use) is a warning, not a stall
    (servers.lake / "landing" / "payments" / "zz-arrived-later.jsonl").write_text("not json\n")
    deadline = time.monotonic() + 150
    description = ""
    while time.monotonic() < deadline and "idle" not in description:
        time.sleep(5)
        with DagsterInstance.from_config(str(servers.dagster_home)) as instance:
            records = instance.event_log_storage.get_asset_check_execution_history(
                AssetCheckKey(stream_asset, "checkpoint_health"), limit=1)
            evaluation = records[0].event.dagster_event.event_specific_data if records else None
            description = evaluation.description if evaluation else ""
    assert "idle" in description, description
    assert evaluation.severity.value == "WARN" and "stalled" not in description


ARTIFACTS = Path(os.environ.get("LAKESTREAM_TEST_ARTIFACTS", REPO / "test-artifacts")) / "dagster-ui"


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium); .ci/run installs it")
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("profile")), executable_path=chromium, headless=True,
            viewport={"width": 1600, "height": 1000},
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"])
        yield context
        context.close()


def _new_page(browser, servers):
    """A page on an instance whose "join the community" dialog was dismissed once, as Dagster records it after the
    first Skip (``$DAGSTER_HOME/.nux/nux.yaml``): in a fresh-clone CI on a loaded machine a dialog backdrop took
    every click meant for its Skip button for 30 s. Should the dialog still appear, a handler dismisses every copy
    by dispatching the click to each Skip button (no pointer, so no backdrop is in the way)."""
    seen = servers.dagster_home / ".nux" / "nux.yaml"
    seen.parent.mkdir(parents=True, exist_ok=True)
    seen.write_text("seen: 1\n")
    page = browser.new_page()
    skip = page.get_by_role("button", name="Skip")

    def dismiss():
        for button in reversed(skip.all()):
            button.dispatch_event("click")

    page.add_locator_handler(skip, dismiss)
    return page


def _open(page, url: str) -> None:
    """Go to ``url`` and give the UI two seconds to draw (``_new_page`` keeps the community dialog away)."""
    page.goto(url, wait_until="networkidle", timeout=120_000)
    page.wait_for_timeout(2000)


def _drawn(page, ready, shot: str, timeout: float = 60.0) -> tuple[list[str], str]:
    """The page's asset links and text once ``ready(links, text)`` holds, or after ``timeout`` s (the caller's
    assertion then fails with what was there): Dagster's UI draws graphs and tabs after the network goes
    idle, which took longer than a fixed 2 s on a loaded 2-core machine. The page is saved as ``shot``."""
    deadline = time.monotonic() + timeout
    while True:
        links = page.eval_on_selector_all("a[href*='/assets/']", "els => els.map(e => e.getAttribute('href'))")
        text = page.inner_text("body")
        if ready(links, text) or time.monotonic() > deadline:
            page.screenshot(path=str(ARTIFACTS / shot))
            return links, text
        page.wait_for_timeout(500)


def _menu_item(page, name: str, tries: int = 3) -> None:
    """Click ``name`` in the menu beside Materialize. On a loaded machine the page re-renders while the menu is open
    and the item is detached from the DOM under the click: the menu is opened again (the click itself is asserted)."""
    for attempt in range(tries):
        page.locator("button:right-of(:text('Materialize…'))").first.click()  # the menu beside Materialize
        try:
            page.get_by_text(name, exact=True).click(timeout=10_000)
            return
        except Exception:  # noqa: BLE001 - playwright's TimeoutError; the last attempt's is raised
            if attempt == tries - 1:
                raise
            page.keyboard.press("Escape")


def _has(*words: str):
    return lambda _links, text: all(w in text for w in words)


def test_the_ui_backfills_a_day_twice_and_shows_the_checks_partitions_and_the_stream(servers, browser):
    """Clicked as a user does: the table's launchpad, the day, `force: true`, Materialize — twice; then
    the reconciliation check's Partitions tab and the stream's own checks. Screenshots in ARTIFACTS."""
    base = f"http://127.0.0.1:{servers.port}"
    page = _new_page(browser, servers)
    for attempt in (1, 2):
        _open(page, f"{base}/assets/{'/'.join(MAIN)}")
        _menu_item(page, "Open launchpad")
        page.get_by_role("button", name="Confirm").click()  # the late table comes along (one multi-asset)
        partition = page.get_by_placeholder("Partition")
        partition.click()
        partition.fill(DAY)
        page.wait_for_timeout(1000)
        page.keyboard.press("Enter")
        page.wait_for_timeout(1000)
        editor = page.locator(".CodeMirror")
        assert "spark.jars" not in editor.inner_text() and "/" not in editor.inner_text()  # no machine paths
        editor.get_by_text("false", exact=True).dblclick()  # force: false -> true (the day is the stream's)
        page.keyboard.type("true")
        page.wait_for_timeout(1000)
        page.screenshot(path=str(ARTIFACTS / f"launchpad-{attempt}.png"))
        page.get_by_role("button", name="Materialize").last.click()
        page.wait_for_url("**/runs/**", timeout=60_000)
        run_id = page.url.rstrip("/").rsplit("/", 1)[-1].split("?")[0]
        assert servers.wait_run(run_id, timeout=420) == "SUCCESS", servers.run_log(run_id)
        _open(page, f"{base}/runs/{run_id}")
        page.screenshot(path=str(ARTIFACTS / f"backfill-run-{attempt}.png"))

    _open(page, f"{base}/assets/{'/'.join(MAIN)}?view=checks")
    page.get_by_text("reconciliation", exact=True).first.click()
    page.wait_for_timeout(2000)
    page.get_by_text("Partitions", exact=True).nth(1).click()  # the check's tab (the first is the asset's)
    counted = _has("Passed (1)", "In Progress (0)", "Execution Failed (0)")
    _, text = _drawn(page, counted, "reconciliation-partitions.png")
    assert "Passed (1)" in text and "In Progress (0)" in text and "Execution Failed (0)" in text, text[:2000]

    _open(page, f"{base}/assets/streams/purchase_metrics?view=checks")
    _, text = _drawn(page, _has("checkpoint_health", "stream_supervisor"), "stream-checks.png")
    assert "checkpoint_health" in text and "stream_supervisor" in text
    assert "In Progress" not in text  # the stream's checks are not planned by the table's backfills

    _open(page, f"{base}/assets/{'/'.join(MAIN)}?view=events")
    _, text = _drawn(page, _has("dagster/row_count"), "table-events.png")
    assert "dagster/row_count" in text
    page.close()


def test_the_ui_shows_the_lineage_from_landing_through_the_job_to_a_dbt_mart(servers, browser):
    base = f"http://127.0.0.1:{servers.port}/assets"
    page = _new_page(browser, servers)

    def upstream_of(path: str, ready) -> tuple[list[str], str]:
        _open(page, f"{base}/{path}?view=lineage&lineageScope=upstream&lineageDepth=1")
        page.wait_for_selector("text=Lineage", timeout=60_000)
        return _drawn(page, ready, f"lineage-{path.replace('/', '-')}.png")

    def reads_the_table(links, _text):
        return any(link.startswith("/assets/lake/payments/purchase_metrics") for link in links)

    links, _ = upstream_of("lake/marts/user_daily_activity", reads_the_table)  # the dbt mart ...
    assert reads_the_table(links, ""), links  # ... reads the job's table
    # ... which reads the landing zone and the stream
    _, text = upstream_of("lake/payments/purchase_metrics", _has("landing", "payments", "json", "streams"))
    page.close()
    assert "landing" in text and "payments" in text and "json" in text and "streams" in text, text[:2000]
