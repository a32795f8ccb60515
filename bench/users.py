"""lakestream as users meet it, side by side with the plain-Spark script they would write instead (``make bench``).

Every figure is taken from whole processes started fresh from a shell, as the CLI and every Dagster run
start one: ``lakestream run ... --available-now``, ``lakestream backfill``, ``lakestream run`` under a live
feeder, against ``bench/peer.py`` (text source, ``from_json``, ``withWatermark``, window, Iceberg append). The
two sides alternate, and each figure is the median of ``--runs`` runs. lakestream runs with the project's
default settings (no ``jobs:`` block: its trigger, its out-of-orderness, its dedup TTL).

The input is the product's own generator (``lakestream generate``): payments of several hundred users,
events up to 5 s out of order, 0.5 % arriving 2-20 minutes late, 0.2 % delivered twice, 0.1 % malformed.

Sections (``--only a,b``; all by default):

* ``cold``     one file of 500 payments: process start to the first batch committed (cold start);
* ``stream``   1M payments, ``run purchase_metrics --available-now`` with the defaults (the whole landing
               folder in one batch) vs the peer's availableNow stream;
* ``paced``    the same, one file per trigger on both sides (``--max-files-per-trigger 1``): per-batch cost;
* ``delta``    ``stream`` with the tables in Delta (``LAKESTREAM_FORMAT=delta``) vs the same peer (Iceberg);
* ``bounded``  ``backfill purchase_metrics`` over the day vs the peer's ``spark.read`` batch;
* ``latency``  5,000 payments/s as 500-event files every 0.1 s (with the same disorder), ``run JOB`` with
               its defaults vs the peer with Spark's default trigger: from a file's appearance to the commit
               of the batch that read it (the checkpoint's logs, read from outside), for ``purchase_metrics``
               and the keyed ``large_amount_alerts``; beside them, as a reference, the same feed through what a
               Spark user writes for the keyed job (``peer.py live-keyed``: ``applyInPandasWithState``);
* ``keyed``    ``run large_amount_alerts --available-now`` and the keyed twins (``backfill`` of
               ``large_amount_alerts`` and ``rolling_spend``) against the windowed twin's rate;
* ``flat``     a keyed batch's cost after 20,000 remembered keys vs after 1M (the same number of payments
               before the measured batches; whole process, one file per trigger, commit-to-commit);
* ``flat-ids`` the same vs after each of 1,000 cards remembered 3,000 ids (a key's ids grow with its rate x
               ``dedup_ttl``), batches of the latency feed's size over those cards;
* ``bigdelta`` a backfill whose Delta output is >= 5M rows under a 1 GiB driver heap.

Beside every ratio: the first commit (process start to the first batch committed) and the peak memory of the
process tree (driver Python + JVM; on a local master the JVM is also the executors). lakestream's
per-step breakdown is the one its CLI prints (``time per step``).

Results go to ``bench/out/users-<time>.json`` and a table on standard output.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from common import latency, write_file  # noqa: E402

BIN = Path(sys.executable).parent
LAKESTREAM = str(BIN / "lakestream")
PYTHON = sys.executable
DAY = "2026-11-20"
RESULTS: list[dict] = []


def say(text: str) -> None:
    print(text, flush=True)


# -- processes -------------------------------------------------------------------------------------

def _tree(root: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(parents.get(pid, []))
    return out


def _rss_mb(pids: list[int]) -> float:
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, IndexError, ValueError):
            pass
    return total / 2**20


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(stat_path: str) -> float:
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # (utime + stime)


def cpu_by_part(root: int) -> dict[str, float]:
    """CPU seconds so far of ``root``'s process tree by part: the JVM's JIT compiler threads, the rest of the JVM,
    Spark's Python workers, the other Python (the driver's); and ``machine``, every process's. Linux only (empty
    elsewhere)."""
    parts = dict.fromkeys(("JIT", "JVM", "Python workers", "driver"), 0.0)
    for pid in _tree(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            if b"java" in cmdline.split(b"\0", 1)[0]:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    try:
                        with open(f"/proc/{pid}/task/{tid}/comm") as f:
                            name = f.read()
                        parts["JIT" if "CompilerThre" in name else "JVM"] += _cpu_seconds(f"/proc/{pid}/task/{tid}/stat")
                    except (OSError, IndexError, ValueError):
                        pass  # (a thread that ended: its time left with it; the parts are lower bounds)
            else:
                worker = b"pyworkers" in cmdline or b"pyspark.daemon" in cmdline or b"pyspark.worker" in cmdline
                parts["Python workers" if worker else "driver"] += _cpu_seconds(f"/proc/{pid}/stat")
        except (OSError, IndexError, ValueError):
            continue
    if not any(parts.values()):
        return {}
    try:  # the whole machine's busy time (every process: what the parts leave out shows as the rest)
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        parts["machine"] = (sum(ticks) - ticks[3] - ticks[4]) / _TICK  # (all but idle and iowait)
    except (OSError, IndexError, ValueError):
        pass
    return parts


def cpu_line(before: dict, after: dict, seconds: float, feed: float) -> str:
    """The cores each part used over ``seconds`` (the window as timed), and the bench's own (``feed``: CPU seconds
    of this process, the feed's thread most of them). A thread or worker that ended in the window took its time with
    it: the parts are lower bounds, the machine's figure is not."""
    if not before or not after or seconds <= 0:
        return ""
    used = {k: max(0.0, after[k] - before.get(k, 0.0)) / seconds for k in after if k in before}
    used["bench (feed)"] = feed / seconds
    machine = used.pop("machine", None)
    return (f"cores used (of {os.cpu_count()}): " + ", ".join(f"{k} {v:.2f}" for k, v in used.items())
            + (f"; machine busy {machine:.2f}" if machine is not None else ""))


@dataclass
class Run:
    wall: float
    peak_mb: float
    out: str
    rc: int
    started: float  # wall clock at the process start


def run(cmd: list[str], env: dict, *, stop_after: threading.Event | None = None, timeout: float = 3600,
        pid: list | None = None) -> Run:
    """Run ``cmd`` as a whole process; its wall time and the peak RSS of its process tree. With ``stop_after``,
    the process is sent SIGINT once the event is set (a continuous stream). ``pid``: a list the process's id is
    appended to once it started."""
    started = time.time()
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(ROOT))
    if pid is not None:
        pid.append(proc.pid)
    peak = 0.0
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    signalled = False
    while proc.poll() is None:
        peak = max(peak, _rss_mb(_tree(proc.pid)))
        if stop_after is not None and stop_after.is_set() and not signalled:
            proc.send_signal(signal.SIGINT)
            signalled = True
        if time.perf_counter() - t > timeout:
            proc.kill()
        time.sleep(0.2)
    reader.join(10)
    out = "".join(lines)
    if proc.returncode != 0 and not signalled:
        say(f"    command failed ({proc.returncode}): {' '.join(cmd)}\n" + "\n".join(out.splitlines()[-15:]))
    return Run(time.perf_counter() - t, peak, out, proc.returncode, started)


def first_commit(checkpoint: Path, started: float) -> float | None:
    commit = checkpoint / "commits" / "0"
    return commit.stat().st_mtime - started if commit.exists() else None


def commit_intervals(checkpoint: Path) -> list[float]:
    folder = checkpoint / "commits"
    if not folder.exists():
        return []
    times = sorted(p.stat().st_mtime for p in folder.iterdir() if p.name.isdigit())
    return [b - a for a, b in zip(times, times[1:])]


def steps(out: str) -> str:
    for line in out.splitlines():
        if "time per step:" in line:
            return line.split("time per step:", 1)[1].strip()
    return ""


# -- the two sides ------------------------------------------------------------------------------------

class Bench:
    def __init__(self, out: Path, runs: int, events: int, users: int):
        self.out = out
        self.runs = runs
        self.events = events
        self.users = users
        self.n = 0

    def home(self, label: str, landing: Path | None = None, **settings) -> Path:
        """A fresh lake home for one run (its own tables, checkpoints and Dagster nothing), reading ``landing``."""
        self.n += 1
        home = self.out / "runs" / f"{self.n:03d}-{label}"
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
        lines = []
        if landing is not None:
            lines.append(f"landing: {landing}")
        for key, value in settings.items():
            lines.append(f"{key}: {json.dumps(value)}")
        if lines:
            (home / "lakestream.yaml").write_text("\n".join(lines) + "\n")
        return home

    def env(self, home: Path | None = None, **extra) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LAKESTREAM_")}
        env["PYTHONUNBUFFERED"] = "1"
        if home is not None:
            env["LAKESTREAM_HOME"] = str(home)
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def generate(self, label: str, *args: str) -> Path:
        """Landing files from the product's generator (kept between invocations: the same arguments write the
        same bytes)."""
        data = self.out / "data" / label
        marker = data / ".args"
        wanted = " ".join(args)
        if marker.exists() and marker.read_text() == wanted:
            return data / "landing"
        shutil.rmtree(data, ignore_errors=True)
        data.mkdir(parents=True)
        t = time.perf_counter()
        r = run([LAKESTREAM, "generate", *args], self.env(data))
        if r.rc != 0:
            raise SystemExit(f"generate failed:\n{r.out}")
        marker.write_text(wanted)
        say(f"  input {label}: {r.out.strip().splitlines()[0]} ({time.perf_counter() - t:.0f} s)")
        return data / "landing"

    def payments(self) -> Path:
        seconds = max(60, self.events // 1000)
        return self.generate("payments", "--duration", f"{seconds}s", "--rate", str(self.events / seconds),
                             "--users", str(self.users), "--file-seconds", str(max(1, seconds // 20)))

    def peer(self, mode: str, landing: Path, *extra: str) -> tuple[Run, Path]:
        home = self.home(f"peer-{mode}")
        r = run([PYTHON, str(HERE / "peer.py"), mode, "--landing", str(landing / "payments"), "--home", str(home), *extra],
                self.env())
        return r, home / "checkpoint"

    def lakestream(self, args: list[str], landing: Path, job: str, *, fmt: str | None = None, **extra_env) -> tuple[Run, Path]:
        home = self.home(f"ls-{args[0]}-{job}", landing)
        env = self.env(home, **extra_env)
        if fmt:
            env["LAKESTREAM_FORMAT"] = fmt
        r = run([LAKESTREAM, *args], env)
        return r, home / "checkpoints" / job


def pace() -> float:
    """The machine's pace at this moment: seconds of a fresh Python process running 20M empty loop iterations. This
    machine's speed drifts by spells (0.5-1.0 s in fast ones, 1.3-2.5 s in slow ones, on 2026-12-02), and the parts of
    a run do not slow alike, so a ratio is compared with another one taken at a similar pace."""
    started = time.perf_counter()
    subprocess.run([PYTHON, "-S", "-c", "for _ in range(20_000_000): pass"], check=False)
    return time.perf_counter() - started


def median(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def record(section: str, measure: str, plain, ours, ratio: float | None, target: str, met: bool | None, **details) -> None:
    RESULTS.append(dict(section=section, measure=measure, plain=plain, lakestream=ours, ratio=ratio, target=target,
                        met=met, **details))
    verdict = "" if met is None else ("MET" if met else "NOT MET")
    r = "" if ratio is None else f"{ratio:.2f}x"
    say(f"  => {measure}: plain {plain} | lakestream {ours} | {r} {target} {verdict}")


# -- sections ---------------------------------------------------------------------------------------

def _throughput(b: Bench, section: str, measure: str, ls_args: list[str], peer_args: list[str], fmt: str | None = None,
                target: float = 0.9) -> None:
    landing = b.payments()
    plain_t, ours_t, plain_cold, ours_cold, plain_mem, ours_mem, plain_batch, ours_batch = ([] for _ in range(8))
    breakdown = ""
    for i in range(b.runs):
        p, pcp = b.peer("stream", landing, *peer_args)
        o, ocp = b.lakestream(ls_args, landing, "purchase_metrics", fmt=fmt)
        plain_t.append(p.wall)
        ours_t.append(o.wall)
        plain_cold.append(first_commit(pcp, p.started))
        ours_cold.append(first_commit(ocp, o.started))
        plain_mem.append(p.peak_mb)
        ours_mem.append(o.peak_mb)
        plain_batch.append(_gap(pcp))
        ours_batch.append(_gap(ocp))
        breakdown = steps(o.out)
        say(f"  run {i + 1}: peer {p.wall:.1f} s (first commit {plain_cold[-1] or 0:.1f} s, {p.peak_mb:.0f} MB), "
            f"lakestream {o.wall:.1f} s (first commit {ours_cold[-1] or 0:.1f} s, {o.peak_mb:.0f} MB); {breakdown}")
    ratio = median(plain_t) / median(ours_t)
    record(section, measure, f"{median(plain_t):.1f} s", f"{median(ours_t):.1f} s", ratio, f">= {target}x",
           ratio >= target, cold_start=[median(plain_cold), median(ours_cold)], peak_mb=[median(plain_mem), median(ours_mem)],
           batch_s=[median(plain_batch), median(ours_batch)], steps=breakdown, runs=[plain_t, ours_t])
    cold = median(ours_cold) - median(plain_cold)
    record(section, f"first commit ({measure})", f"{median(plain_cold):.1f} s", f"{median(ours_cold):.1f} s (+{cold:.1f} s)",
           None, "reference", None)
    say(f"     peak memory: peer {median(plain_mem):.0f} MB, lakestream {median(ours_mem):.0f} MB; "
        f"batch (commit to commit, median): peer {_seconds(median(plain_batch))}, lakestream {_seconds(median(ours_batch))}")


def _gap(checkpoint: Path) -> float | None:
    """The median time from one commit to the next (None: one batch, no gap to time)."""
    gaps = commit_intervals(checkpoint)
    return median(gaps) if gaps else None


def _seconds(value: float) -> str:
    return "one batch" if value != value else f"{value:.2f} s"  # (NaN: no run had two batches)


def stream(b: Bench) -> None:
    say(f"\n[stream] {b.events:,} payments, run --available-now with the defaults vs the peer's availableNow")
    _throughput(b, "stream", "stream, defaults", ["run", "purchase_metrics", "--available-now"], [])


def paced(b: Bench) -> None:
    say(f"\n[paced] {b.events:,} payments, one file per trigger on both sides")
    _throughput(b, "paced", "stream, one file per trigger",
                ["run", "purchase_metrics", "--available-now", "--max-files-per-trigger", "1"],
                ["--max-files-per-trigger", "1"])


def _cold_landing(b: Bench) -> Path:
    landing = b.out / "data" / "cold" / "landing"
    if not (landing / "payments" / "one.jsonl").exists():
        (landing / "payments").mkdir(parents=True, exist_ok=True)
        write_file(landing / "payments", "one.jsonl", LivePayments(b.users, seed=9).lines(500))
    return landing


def first_use(b: Bench) -> None:
    """One lakestream process before anything is timed, as on a machine where lakestream ran before: the first
    process of a machine records the JVM's class archive (``streaming/spark/classarchive.py``) that every later
    process maps. Users pay that once; the bench reports it and does not time it."""
    t = time.perf_counter()
    o, _ = b.lakestream(["run", "purchase_metrics", "--available-now"], _cold_landing(b), "purchase_metrics")
    recorded = "class archive" in o.out
    say(f"first use on this machine: {time.perf_counter() - t:.1f} s"
        + (" (recorded the JVM's class archive: once per machine, not timed below)" if recorded else
           " (the JVM's class archive was already there)"))


def cold(b: Bench) -> None:
    """Process start to the first batch committed, on a landing folder of one small file (500 payments): what
    a stream costs before its first result, both sides started cold."""
    say("\n[cold] one file of 500 payments: process start to the first batch committed")
    landing = _cold_landing(b)
    plain, ours = [], []
    for i in range(b.runs):
        p, pcp = b.peer("stream", landing)
        o, ocp = b.lakestream(["run", "purchase_metrics", "--available-now"], landing, "purchase_metrics")
        plain.append(first_commit(pcp, p.started))
        ours.append(first_commit(ocp, o.started))
        say(f"  run {i + 1}: peer first commit {plain[-1] or 0:.1f} s (exit {p.wall:.1f} s), lakestream {ours[-1] or 0:.1f} s "
            f"(exit {o.wall:.1f} s); {steps(o.out)}")
    extra = median(ours) - median(plain)
    record("cold", "cold start, first batch committed", f"{median(plain):.1f} s", f"{median(ours):.1f} s (+{extra:.1f} s)",
           None, "<= plain + 2 s", extra <= 2.0, runs=[plain, ours])


def delta(b: Bench) -> None:
    say(f"\n[delta] {b.events:,} payments, run --available-now with Delta tables vs the peer (Iceberg)")
    _throughput(b, "delta", "Delta stream, defaults", ["run", "purchase_metrics", "--available-now"], [], fmt="delta")


def bounded(b: Bench) -> None:
    say(f"\n[bounded] {b.events:,} payments, backfill purchase_metrics vs the peer's spark.read batch")
    landing = b.payments()
    plain_t, ours_t, plain_mem, ours_mem = [], [], [], []
    for i in range(b.runs):
        p, _ = b.peer("batch", landing)
        o, _ = b.lakestream(["backfill", "purchase_metrics", "--start", DAY, "--end", "2026-11-21"], landing,
                            "purchase_metrics")
        plain_t.append(p.wall)
        ours_t.append(o.wall)
        plain_mem.append(p.peak_mb)
        ours_mem.append(o.peak_mb)
        say(f"  run {i + 1}: peer {p.wall:.1f} s ({p.peak_mb:.0f} MB), lakestream {o.wall:.1f} s ({o.peak_mb:.0f} MB): "
            f"{o.out.strip().splitlines()[-1] if o.out.strip() else ''}")
    ratio = median(plain_t) / median(ours_t)
    record("bounded", "bounded twin", f"{median(plain_t):.1f} s", f"{median(ours_t):.1f} s", ratio, ">= 0.9x", ratio >= 0.9,
           peak_mb=[median(plain_mem), median(ours_mem)], runs=[plain_t, ours_t])


# -- latency ------------------------------------------------------------------------------------------

class LivePayments:
    """Payments happening now: event times up to 5 s behind their arrival, 0.5 % 2-20 minutes behind, 0.2 %
    delivered twice, 0.1 % malformed (what ``lakestream generate`` writes, produced live)."""

    def __init__(self, users: int, seed: int = 5):
        self.rng = random.Random(seed)
        self.users = users
        self.seq = 0
        self.recent: list[str] = []

    def lines(self, n: int) -> list[str]:
        now = time.time()
        out = []
        for _ in range(n):
            self.seq += 1
            r = self.rng.random()
            if r < 0.002 and self.recent:
                out.append(self.rng.choice(self.recent))
                continue
            lag = self.rng.uniform(120, 1200) if r < 0.007 else self.rng.uniform(0, 5)
            t = now - lag
            user = self.rng.randrange(self.users)
            line = json.dumps({
                "event_id": f"live-{self.seq}", "event_time": _iso(t), "card_id": f"c{user:05d}-{self.seq % 3}",
                "user_id": f"u{user:05d}", "merchant_id": f"m{self.rng.randrange(200):04d}",
                "amount": round(self.rng.lognormvariate(3.5, 1.0), 2), "currency": "EUR",
                "status": "DECLINED" if self.rng.random() < 0.08 else "APPROVED"}, separators=(",", ":"))
            if r > 0.999:
                line = line.replace('"amount":', '"amount":"twelve","x":')
            out.append(line)
            if len(self.recent) < 1000:
                self.recent.append(line)
            elif self.rng.random() < 0.01:
                self.recent[self.rng.randrange(1000)] = line
        return out


def _iso(seconds: float) -> str:
    ms = int(seconds * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z"


def _feed(landing: Path, rate: int, per_file: int, seconds: float, appeared: dict, users: int) -> None:
    gen = LivePayments(users)
    interval = per_file / rate
    next_at = time.time()
    end = next_at + seconds
    n = 0
    while time.time() < end:
        name = f"live-{n:06d}.jsonl"
        appeared[name] = write_file(landing, name, gen.lines(per_file))
        n += 1
        next_at += interval
        time.sleep(max(0.0, next_at - time.time()))


# The latency runs of the plain-Spark scripts: the windowed peer (the target's), and what a Spark user writes for the
# keyed job (``peer.py live-keyed``: ``applyInPandasWithState``), a reference for what Spark's Python state API costs.
PEERS = {"peer": "live", "peer-keyed": "live-keyed"}


def _latency_run(b: Bench, who: str, warmup: float, measure: float, rate: int, per_file: int):
    landing_root = b.out / "runs" / f"live-{who}-{b.n}"
    shutil.rmtree(landing_root, ignore_errors=True)
    landing = landing_root / "payments"
    landing.mkdir(parents=True)
    stop = threading.Event()
    appeared: dict[str, float] = {}
    if who in PEERS:
        home = b.home(who)
        cmd = [PYTHON, str(HERE / "peer.py"), PEERS[who], "--landing", str(landing), "--home", str(home)]
        env = b.env()
        checkpoint = home / "checkpoint"
    else:
        home = b.home(f"ls-live-{who}", landing_root,  # (as the peer: every batch's commit kept for the reading)
                      spark={"conf": {"spark.sql.streaming.minBatchesToRetain": "1000"}})
        cmd = [LAKESTREAM, "run", who]
        env = b.env(home)
        checkpoint = home / "checkpoints" / who
    result: list[Run] = []
    pid: list[int] = []
    runner = threading.Thread(target=lambda: result.append(run(cmd, env, stop_after=stop, pid=pid)), daemon=True)
    runner.start()
    time.sleep(3)  # the process starts; the feed begins as a user's files would, whenever
    since = time.time() + warmup
    # Where the machine's cores go in the measured window, both sides alike (a stream that cannot keep up with the
    # feed shows it in its latency: on two cores the JVMs' JIT compilers take a large share of the first minutes).
    cpu: dict[str, tuple] = {}
    mark = threading.Timer(warmup, lambda: cpu.update(
        before=(cpu_by_part(pid[0]) if pid else {}, time.process_time(), time.monotonic())))
    mark.start()
    _feed(landing, rate, per_file, warmup + measure, appeared, b.users)
    mark.join()
    cores = ""
    if "before" in cpu:
        parts, bench_cpu, at = cpu["before"]
        cores = cpu_line(parts, cpu_by_part(pid[0]) if pid else {}, time.monotonic() - at,
                         time.process_time() - bench_cpu)
    deadline = time.time() + 30
    while time.time() < deadline and len(latency(str(checkpoint), appeared, 0).samples) < len(appeared):
        time.sleep(0.5)
    stop.set()
    runner.join(120)
    lat = latency(str(checkpoint), appeared, since)
    missing = sum(1 for at in appeared.values() if at >= since) - len(lat.samples)
    lat.samples.extend([float("inf")] * missing)  # (a file not committed 30 s after the feed ended counts as never)
    r = result[0] if result else None
    say(f"  {who:20} {lat.line()}{f'; {missing} file(s) not committed' if missing else ''}"
        + (f"; peak {r.peak_mb:.0f} MB" if r else "") + (f"; {steps(r.out)}" if r and steps(r.out) else "")
        + (f"\n  {'':20} {cores}" if cores else ""))
    return lat, (r.peak_mb if r else None)


KEYED_JOBS = ("large_amount_alerts",)


def latency_section(b: Bench, jobs=("purchase_metrics", "large_amount_alerts"), warmup: float = 45, measure: float = 60,
                    rate: int = 5000, per_file: int = 500) -> None:
    say(f"\n[latency] {rate:,} payments/s as {per_file}-event files every {per_file / rate:.2f} s (disorder, late, "
        f"duplicates, malformed), defaults on both sides; {warmup:.0f} s warm-up, {measure:.0f} s measured")
    peer_p99: list[float] = []
    ours: dict[str, list[float]] = {j: [] for j in jobs}
    ours50: dict[str, list[float]] = {j: [] for j in jobs}
    peer50: list[float] = []
    keyed_peer = any(j in KEYED_JOBS for j in jobs)
    kp99: list[float] = []
    kp50: list[float] = []
    for i in range(b.runs):
        lat, _ = _latency_run(b, "peer", warmup, measure, rate, per_file)
        peer_p99.append(lat.pct(99))
        peer50.append(lat.pct(50))
        for job in jobs:
            lat, _ = _latency_run(b, job, warmup, measure, rate, per_file)
            ours[job].append(lat.pct(99))
            ours50[job].append(lat.pct(50))
        if keyed_peer:
            lat, _ = _latency_run(b, "peer-keyed", warmup, measure, rate, per_file)
            kp99.append(lat.pct(99))
            kp50.append(lat.pct(50))
    plain = f"p50 {median(peer50):.2f} s p99 {median(peer_p99):.2f} s"
    for job in jobs:
        ratio = median(ours[job]) / median(peer_p99)
        record("latency", f"latency p99 {job}", plain,
               f"p50 {median(ours50[job]):.2f} s p99 {median(ours[job]):.2f} s", ratio, "<= 1.2x", ratio <= 1.2,
               runs=[peer_p99, ours[job]])
    if keyed_peer:
        ratio = median(kp99) / median(peer_p99)
        record("latency", "latency p99 plain keyed (applyInPandasWithState)", plain,
               f"p50 {median(kp50):.2f} s p99 {median(kp99):.2f} s", ratio, "reference", None, runs=[peer_p99, kp99])
        for job in jobs:
            if job in KEYED_JOBS:
                ratio = median(ours[job]) / median(kp99)
                record("latency", f"latency p99 {job} vs plain keyed", f"p50 {median(kp50):.2f} s p99 {median(kp99):.2f} s",
                       f"p50 {median(ours50[job]):.2f} s p99 {median(ours[job]):.2f} s", ratio, "reference", None,
                       runs=[kp99, ours[job]])


# -- keyed ---------------------------------------------------------------------------------------------

def keyed(b: Bench) -> None:
    say(f"\n[keyed] {b.events:,} payments: the keyed stream, and the keyed twins against the windowed twin")
    landing = b.payments()
    rates: dict[str, list[float]] = {}
    for i in range(b.runs):
        for job in ("purchase_metrics", "large_amount_alerts", "rolling_spend"):
            o, _ = b.lakestream(["backfill", job, "--start", DAY, "--end", "2026-11-21"], landing, job)
            rates.setdefault(job, []).append(b.events / o.wall)
            say(f"  run {i + 1}: backfill {job} {o.wall:.1f} s ({b.events / o.wall:,.0f} events/s, {o.peak_mb:.0f} MB)")
        o, cp = b.lakestream(["run", "large_amount_alerts", "--available-now"], landing, "large_amount_alerts")
        rates.setdefault("stream large_amount_alerts", []).append(b.events / o.wall)
        say(f"  run {i + 1}: stream large_amount_alerts {o.wall:.1f} s (first commit {first_commit(cp, o.started) or 0:.1f} s, "
            f"{o.peak_mb:.0f} MB); {steps(o.out)}")
    windowed = median(rates["purchase_metrics"])
    for job in ("large_amount_alerts", "rolling_spend"):
        ratio = median(rates[job]) / windowed
        record("keyed", f"keyed twin {job} vs windowed twin", f"{windowed:,.0f} events/s (purchase_metrics)",
               f"{median(rates[job]):,.0f} events/s", ratio, ">= 0.9x", ratio >= 0.9)
    record("keyed", "keyed stream large_amount_alerts", "", f"{median(rates['stream large_amount_alerts']):,.0f} events/s",
           None, "reference", None)


def flat(b: Bench, keys: int = 1_000_000, batch: int = 20_000, batches: int = 6) -> None:
    """A keyed batch's cost after 20,000 remembered keys vs after ``keys`` (distinct cards): the same
    ``batches`` files after a preload of ``keys`` payments, each over a card of its own, or over the 20,000 cards the
    batches pay with (so that both JVMs have run as much before the measured batches), one per trigger, whole
    process; commit-to-commit medians."""
    say(f"\n[flat] keyed large_amount_alerts: {batches} batches of {batch:,} payments after {keys:,} payments over "
        f"20,000 cards vs over {keys:,} cards")
    rng = random.Random(11)

    def preload(i: int) -> tuple[int, float]:  # each card once, within the first minutes
        return i, i * 120 / keys

    def measured(f: int, i: int) -> tuple[int, float]:  # cards among the first 20k, minutes later
        return rng.randrange(20_000), 180 + f * 10 + i * 10 / batch

    def few_keys(i: int) -> tuple[int, float]:  # the same payments over the measured batches' 20k cards
        return i % 20_000, i * 120 / keys

    _flat(b, f"flat-{keys}-warm", keys, preload, batch, batches, measured,
          f"keyed batch after {keys:,} keys vs after 20,000", baseline_preload=few_keys)


def flat_ids(b: Bench, cards: int = 1_000, per_card: int = 3_000, batch: int = 3_500, batches: int = 12) -> None:
    """A keyed batch's cost after each of ``cards`` cards remembered ``per_card`` ids (its payments of the last
    ``dedup_ttl``: 3M ids are ten minutes of the latency feed's 5k payments/s), batches of the latency feed's size
    over those cards, against the same batches over as many other cards after the same preload (both runs warm,
    with the same state): a key's remembered ids grow with its rate x ``dedup_ttl``."""
    say(f"\n[flat-ids] keyed large_amount_alerts: {batches} batches of {batch:,} payments over {cards:,} cards after "
        f"{per_card:,} payments of each, vs over {cards:,} other cards after the same")
    total = cards * per_card

    def preload(i: int) -> tuple[int, float]:  # every card in turn, over 25 minutes (within the 30-minute dedup_ttl)
        return i % cards, i * 1500 / total

    def measured(offset: int):
        rng = random.Random(12)
        return lambda f, i: (offset + rng.randrange(cards), 1560 + f + i / batch)  # a minute later, 1 s per batch

    _flat(b, f"flat-ids-{cards}-{per_card}", total, preload, batch, batches, measured(0),
          f"keyed batch after {per_card:,} ids per card vs none", baseline=measured(cards))


def _flat(b: Bench, label: str, preloaded: int, preload, batch: int, batches: int, measured, measure: str,
          baseline=None, baseline_preload=None) -> None:
    """``preloaded`` payments (``preload(i)``: card and seconds after the start) in files of 100k, then ``batches``
    files of ``batch`` payments (``measured(file, i)``); run after the preload and against it: on empty state, or
    (``baseline``: the measured payments' cards instead) after the same preload, or (``baseline_preload``) after as
    many payments over fewer cards (so that both sides' JVMs are as warm when the measured batches come), each
    ``--runs`` times, alternated. One file per trigger; the medians of the runs' commit-to-commit medians."""
    data = b.out / "data" / label
    landing = data / "landing" / "payments"
    base = int(datetime(2026, 11, 20, tzinfo=timezone.utc).timestamp())
    rng = random.Random(11)

    def payment(i: int, card: int, t: float) -> str:
        return json.dumps({"event_id": f"f-{i}", "event_time": _iso(base + t), "card_id": f"c{card:07d}-0",
                           "user_id": f"u{card:07d}", "merchant_id": "m0001", "amount": round(rng.uniform(1, 100), 2),
                           "currency": "EUR", "status": "APPROVED"}, separators=(",", ":"))

    if not (data / ".done").exists():
        shutil.rmtree(data, ignore_errors=True)
        landing.mkdir(parents=True)
        per = 100_000
        for f in range(-(-preloaded // per)):
            write_file(landing, f"a-{f:03d}.jsonl", [payment(i, *preload(i)) for i in range(f * per, min(preloaded, (f + 1) * per))])
            time.sleep(0.02)
        for f in range(batches):
            write_file(landing, f"b-{f:03d}.jsonl", [payment(preloaded + f * batch + i, *measured(f, i)) for i in range(batch)])
            time.sleep(0.02)
        (data / ".done").write_text("")
    empty = data / "empty" / "payments"
    if not (data / "empty" / ".done").exists():
        shutil.rmtree(empty, ignore_errors=True)
        empty.mkdir(parents=True)
        if baseline_preload is not None:  # (as many payments, over fewer cards)
            per = 100_000
            for f in range(-(-preloaded // per)):
                write_file(empty, f"a-{f:03d}.jsonl",
                           [payment(i, *baseline_preload(i)) for i in range(f * per, min(preloaded, (f + 1) * per))])
                time.sleep(0.02)
        for p in sorted(landing.glob("a-*.jsonl")) if baseline else []:  # (the same preload, as old as the landing's)
            shutil.copy2(p, empty / p.name)
        for f in range(batches):  # (new modification times: the source reads files in their order)
            if baseline:
                write_file(empty, f"b-{f:03d}.jsonl", [payment(preloaded + f * batch + i, *baseline(f, i)) for i in range(batch)])
            else:
                shutil.copyfile(landing / f"b-{f:03d}.jsonl", empty / f"b-{f:03d}.jsonl")
            time.sleep(0.02)
        (data / "empty" / ".done").write_text("")
    # Each side runs ``--runs`` times, the two alternated (the machine's speed drifts between runs); a side's figure
    # is the median of its runs' commit-to-commit medians.
    figures: dict[str, list[float]] = {"empty": [], "loaded": []}
    base_name = "other cards" if baseline else "fewer keys" if baseline_preload else "empty"
    preload_files = -(-preloaded // 100_000)
    for i in range(b.runs):
        for name, folder, skip in (("empty", empty.parent, preload_files + 1 if baseline or baseline_preload else 1),
                                   ("loaded", landing.parent, preload_files + 1)):
            o, cp = b.lakestream(["run", "large_amount_alerts", "--available-now", "--max-files-per-trigger", "1"],
                                 folder, "large_amount_alerts")
            intervals = commit_intervals(cp)[skip - 1:]
            figures[name].append(median(intervals))
            say(f"  run {i + 1}: {base_name if name == 'empty' else name}: batches "
                f"{', '.join(f'{s:.2f}' for s in intervals)} s apart (median {figures[name][-1]:.2f} s); {steps(o.out)}")
    figures = {name: median(values) for name, values in figures.items()}
    ratio = figures["loaded"] / figures["empty"]
    record("flat", measure, f"{base_name} {figures['empty']:.2f} s", f"loaded {figures['loaded']:.2f} s", ratio, "<= 1.25x",
           ratio <= 1.25)


def bigdelta(b: Bench) -> None:
    """A backfill whose Delta output has >= 5M rows, the driver's heap at 1 GiB: data files written by the
    executors, only their descriptions reach the driver."""
    say("\n[bigdelta] backfill to Delta with >= 5M output rows, spark.driver.memory=1g")
    landing = b.generate("bigdelta", "--duration", "6h", "--rate", "300", "--users", "250000", "--skew", "0",
                         "--file-seconds", "600", "--late-fraction", "0", "--duplicate-fraction", "0")
    home = b.home("ls-bigdelta", landing, spark={"conf": {"spark.driver.memory": "1g"}})
    env = b.env(home, LAKESTREAM_FORMAT="delta")
    r = run([LAKESTREAM, "backfill", "purchase_metrics", "--start", DAY, "--end", "2026-11-21"], env)
    say(f"  {r.out.strip().splitlines()[-1] if r.out.strip() else ''} ({r.wall:.0f} s, peak {r.peak_mb:.0f} MB, rc {r.rc})")
    rows = None
    try:
        from deltalake import DeltaTable

        rows = sum(DeltaTable(str(home / "delta" / "payments" / "purchase_metrics")).to_pyarrow_dataset().count_rows()
                   for _ in [0])
    except Exception as exc:  # noqa: BLE001
        say(f"  could not count the table's rows: {exc}")
    record("bigdelta", "Delta backfill, driver heap 1 GiB", "", f"{rows:,} rows in {r.wall:.0f} s" if rows else f"rc {r.rc}",
           None, ">= 5M rows, rc 0", bool(rows and rows >= 5_000_000 and r.rc == 0), peak_mb=r.peak_mb)


SECTIONS = {"cold": cold, "stream": stream, "paced": paced, "delta": delta, "bounded": bounded, "latency": latency_section,
            "keyed": keyed, "flat": flat, "flat-ids": flat_ids, "bigdelta": bigdelta}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help=f"comma-separated sections of {', '.join(SECTIONS)}")
    parser.add_argument("--runs", type=int, default=3, help="alternated runs per side (medians)")
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--users", type=int, default=1000)
    parser.add_argument("--out", default=str(HERE / "out"))
    args = parser.parse_args()
    chosen = [s for s in (args.only.split(",") if args.only else SECTIONS) if s]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; known: {', '.join(SECTIONS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    b = Bench(out, args.runs, args.events, args.users)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    say(f"lakestream as users run it: {datetime.now().strftime('%Y-%m-%d %H:%M')}, commit {commit}, {os.cpu_count()} cores, "
        f"{args.runs} alternated runs per side")
    began = time.time()
    paces = {"start": pace()}
    say(f"the machine's pace: a 20M-iteration Python loop in {paces['start']:.2f} s (see ``pace``)")
    first_use(b)
    for name in chosen:
        SECTIONS[name](b)
        paces[name] = pace()
        say(f"  (the machine's pace after [{name}]: {paces[name]:.2f} s)")
    say(f"\n== results ({(time.time() - began) / 60:.0f} min; the machine's pace "
        f"{min(paces.values()):.2f}-{max(paces.values()):.2f} s) ==")
    for r in RESULTS:
        verdict = "" if r["met"] is None else ("MET" if r["met"] else "NOT MET")
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        say(f"  {r['measure']:45} plain {str(r['plain']):28} lakestream {str(r['lakestream']):30} {ratio:7} "
            f"{r['target']:16} {verdict}")
    stamp = datetime.now().strftime("%Y%m%dT%H%M")
    (out / f"users-{stamp}.json").write_text(json.dumps(dict(commit=commit, pace_s=paces, results=RESULTS), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
