"""End to end with real processes on loopback: a temporary DAGSTER_HOME, ``dagster-webserver`` and
``dagster-daemon`` started here, driven through the GraphQL API the UI uses, and the UI itself in
headless Chromium. Each run the servers launch is a real subprocess with its own Spark.

Flow: launch the purchase_metrics stream (continuous) -> per-batch materializations appear ->
terminate the run from the API -> the query stopped after its batch (no batch in flight) -> launch
a partition backfill -> the partition is materialized by the bounded twin and its reconciliation
check recorded -> the browser finds the lineage landing -> purchase_metrics -> a dbt mart.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from streaming.checkpoint import inspect_checkpoint
from tests.conftest import SMALL

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
LOCATION = "orchestration.definitions"
DAY = SMALL.start.strftime("%Y-%m-%d")
MAIN = ["lake", "payments", "purchase_metrics"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Servers:
    def __init__(self, root: Path):
        self.root = root
        self.port = _free_port()
        self.dagster_home = root / "dagster"
        self.lake = root / "lake"
        self.procs: list[subprocess.Popen] = []

    def gql(self, query: str, variables: dict | None = None) -> dict:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/graphql", headers={"Content-Type": "application/json"},
            data=json.dumps({"query": query, "variables": variables or {}}).encode())
        result = json.loads(urllib.request.urlopen(request, timeout=60).read())
        assert "errors" not in result, result["errors"]
        return result["data"]

    def start(self) -> None:
        self.dagster_home.mkdir(parents=True)
        (self.root / "workspace.yaml").write_text(
            f"load_from:\n  - python_module:\n      module_name: {LOCATION}\n      working_directory: {REPO}\n")
        env = {**os.environ, "DAGSTER_HOME": str(self.dagster_home), "LAKESTREAM_HOME": str(self.lake),
               "PYSPARK_PYTHON": sys.executable}
        bin_dir = Path(sys.executable).parent
        for cmd, log in (([str(bin_dir / "dagster-webserver"), "-h", "127.0.0.1", "-p", str(self.port), "-w",
                           str(self.root / "workspace.yaml")], "webserver.log"),
                         ([str(bin_dir / "dagster-daemon"), "run", "-w", str(self.root / "workspace.yaml")], "daemon.log")):
            self.procs.append(subprocess.Popen(cmd, cwd=self.root, env=env, stdout=open(self.root / log, "w"),
                                               stderr=subprocess.STDOUT, start_new_session=True))
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


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from streaming.generator import generate

    servers = Servers(tmp_path_factory.mktemp("e2e"))
    generate(SMALL, servers.lake / "landing", sources=("payments",))
    (servers.lake / "lakestream.yaml").write_text(
        "spark: {shuffle_partitions: 2}\njobs: {purchase_metrics: {max_files_per_trigger: 3, trigger_interval: 1s}}\n")
    servers.start()
    yield servers
    servers.stop()
    assert servers.leftovers() == [], "a server process (or one of its children) outlived the stop"


def test_launch_stream_see_batches_terminate_gracefully_then_backfill_a_partition(servers):
    launched = servers.gql(
        "mutation($p: ExecutionParams!) { launchRun(executionParams: $p) { __typename "
        "... on LaunchRunSuccess { run { runId } } ... on PythonError { message } "
        "... on RunConfigValidationInvalid { errors { message } } } }",
        {"p": {"selector": {"repositoryLocationName": LOCATION, "repositoryName": "__repository__",
                            "jobName": "purchase_metrics_stream"},
               "runConfigData": {"ops": {"purchase_metrics": {"config": {
                   "mode": "continuous", "trigger_interval": "1s", "materialize_every": "0s"}}}}}})["launchRun"]
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

    terminated = servers.gql("mutation($id: String!) { terminateRun(runId: $id, terminatePolicy: SAFE_TERMINATE) "
                             "{ __typename } }", {"id": run_id})["terminateRun"]
    assert terminated["__typename"] == "TerminateRunSuccess"
    asked = time.monotonic()
    assert servers.wait_run(run_id, timeout=180) == "CANCELED"
    log = servers.run_log(run_id, last=400)
    print(f"terminated in {time.monotonic() - asked:.1f}s\n{log[-3000:]}")
    assert "SIGINT received; stopped purchase_metrics after batch" in log, log  # taken as a stop request, not an exception
    report = inspect_checkpoint("purchase_metrics", str(servers.lake / "checkpoints" / "purchase_metrics"))
    assert report.last_committed_batch is not None and report.in_flight_batch is None, "stopped after its batch"
    from dagster import DagsterInstance

    from orchestration.streams import DesiredState

    with DagsterInstance.from_config(str(servers.dagster_home)) as instance:
        assert DesiredState(instance, "purchase_metrics").get()["state"] == "stopped"  # not restarted

    # The same day backfilled three times (a retry, a re-run, the schedule): each passes, each evaluates the
    # day's reconciliation in its own run (it used to fail on a UNIQUE constraint from the second on).
    runs = []
    for attempt in range(3):
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

    # Without force the stream's day is refused: the run fails with the launchpad's fix, not a stack trace
    state = servers.backfill([DAY], force=False)
    assert state["status"] in ("COMPLETED_FAILED", "FAILED"), state
    log = servers.run_log(state["runs"][0]["runId"], last=200)
    assert "force: true" in log and "purchase_metrics_bounded" in log, log


def test_the_ui_shows_the_lineage_from_landing_through_the_job_to_a_dbt_mart(servers, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium); .ci/run installs it")
    from playwright.sync_api import sync_playwright

    base = f"http://127.0.0.1:{servers.port}/assets"
    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=chromium, headless=True, viewport={"width": 1600, "height": 1000},
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"])
        page = browser.new_page()

        def upstream_of(path: str) -> tuple[list[str], str]:
            page.goto(f"{base}/{path}?view=lineage&lineageScope=upstream&lineageDepth=1", wait_until="networkidle",
                      timeout=120_000)
            page.wait_for_selector("text=Lineage", timeout=60_000)
            page.wait_for_timeout(2000)
            links = page.eval_on_selector_all("a[href*='/assets/']", "els => els.map(e => e.getAttribute('href'))")
            return links, page.inner_text("body")

        links, _ = upstream_of("lake/marts/user_daily_activity")  # the dbt mart ...
        assert any(link.startswith("/assets/lake/payments/purchase_metrics") for link in links)  # ... reads the job's table
        links, text = upstream_of("lake/payments/purchase_metrics")  # which reads the landing zone
        page.screenshot(path=str(tmp_path / "lineage.png"))
        browser.close()
    assert "landing" in text and "payments" in text and "json" in text
