"""A stream's health, judged from its inspected checkpoint: stalled, a growing backlog, state growth,
rewritten input, corruption, or idle (input waits and nothing runs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (annotations only: inspect imports this module)
    from ..declaration import Job
    from ..settings import Settings
    from .inspect import CheckpointReport
    from .tree import Tree


@dataclass
class Thresholds:
    """When the derived health flags turn on."""

    trigger_interval_s: float = 10.0
    stall_factor: float = 5.0  # stalled: no commit for stall_factor x trigger interval while input waits ...
    stall_batches: float = 3.0  # ... and for this many times the longest recent batch (slow batches are not stalls)
    state_growth_ratio: float = 1.5  # state growth: rows remembered > ratio x after the previous batch ...
    state_growth_min_rows: int = 100_000  # ... and more than this


@dataclass
class Health:
    status: str = "healthy"  # healthy | warning | error
    stalled: bool = False
    in_flight: bool = False
    backlog_growing: bool = False
    state_growth: bool = False
    corrupt: bool = False
    rewritten: bool = False
    idle: bool = False  # input waits and no stream runs: the normal state of on-demand use, a warning
    messages: list[str] = field(default_factory=list)


# A stream that triggers as soon as its last batch committed (the default) is judged as if it triggered every
# 2 s: a file that arrived while a batch ran waits for the next one, which is neither a backlog nor a stall.
INTERVAL_FLOOR_S = 2.0


def job_thresholds(settings: Settings, job: Job) -> Thresholds:
    interval = settings.job(job.name).trigger_interval
    return Thresholds(trigger_interval_s=max(INTERVAL_FLOOR_S, interval.total_seconds() if interval else 0.0))


def age(now_ms: int, then_ms: int | None) -> str:
    if then_ms is None:
        return "never"
    seconds = max(0, now_ms - then_ms) / 1000
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}min ago"


def assess(report: CheckpointReport, limits: Thresholds, root: Tree) -> Health:
    """The health of an inspected checkpoint (see :class:`Health`)."""
    h = Health()
    now = report.inspected_at_ms
    if report.problems:
        h.corrupt = True
        h.messages += [f"corrupt: {p}" for p in report.problems]
    if report.in_flight_batch is not None:
        h.in_flight = True
        h.messages.append(f"batch {report.in_flight_batch} is planned but not committed "
                          f"({'running' if report.running is not None else 'replayed when the stream starts'})")
    if report.files_waiting:
        since = report.last_commit_ms
        if since is None and report.exists:
            try:
                since = root.mtime_ms("metadata")
            except OSError:
                since = None
        longest = max(report.recent_batch_seconds, default=0.0)
        limit_ms = max(limits.stall_factor * limits.trigger_interval_s, limits.stall_batches * longest) * 1000
        overdue = since is not None and now - since > limit_ms and (report.oldest_waiting_ms or now) < now - limit_ms
        # A stream stopped cleanly may leave a batch planned (Spark writes the next offsets before it sees the
        # stop): the batch is replayed when the stream starts, so that is idle too; a crash is not.
        if overdue and report.running is None and (report.in_flight_batch is None or not report.died):
            h.idle = True
            h.messages.append(
                f"idle: {report.files_waiting} file(s) wait (the oldest since {age(now, report.oldest_waiting_ms)}) and "
                f"no stream of {report.job} runs; start it (`lakestream run {report.job}`, or launch "
                f"{report.job}_stream in Dagster) when the data is wanted")
        elif overdue:
            h.stalled = True
            basis = (f"{limits.stall_factor:g} x {limits.trigger_interval_s:g}s trigger interval"
                     if limit_ms == limits.stall_factor * limits.trigger_interval_s * 1000
                     else f"{limits.stall_batches:g} x its longest recent batch, {longest:.0f}s")
            h.messages.append(
                f"stalled: last commit {age(now, report.last_commit_ms)} while {report.files_waiting} file(s) wait "
                f"(limit {limit_ms / 1000:.0f}s: {basis})"
            )
        if report.last_commit_ms is not None and report.oldest_waiting_ms is not None and not h.idle:
            if report.oldest_waiting_ms < report.last_commit_ms - limits.trigger_interval_s * 1000:
                h.backlog_growing = True
                h.messages.append(
                    f"backlog: {report.files_waiting} file(s) ({report.bytes_waiting:,} bytes) wait, the oldest since "
                    f"{age(now, report.oldest_waiting_ms)}, though batches committed after it arrived: input arrives "
                    "faster than the stream consumes it"
                )
    if report.rewritten_files:
        h.rewritten = True
        shown = ", ".join(p.rsplit("/", 1)[-1] for p in report.rewritten_files[:5])
        more = f" and {len(report.rewritten_files) - 5} more" if len(report.rewritten_files) > 5 else ""
        h.messages.append(
            f"rewritten input: {len(report.rewritten_files)} landing file(s) changed after the stream read them "
            f"({shown}{more}); the stream never reads a file twice, so their new lines are missing: write new data "
            "under new file names, and backfill the affected days (lakestream backfill JOB --start ... --end ...)")
    sizes = [report.engine_state_rows[b] for b in sorted(report.engine_state_rows)]
    if len(sizes) >= 2 and sizes[-1] > limits.state_growth_min_rows and sizes[-1] > limits.state_growth_ratio * sizes[-2]:
        h.state_growth = True
        h.messages.append(f"state growth: {sizes[-2]:,} -> {sizes[-1]:,} rows remembered in one batch")
    h.status = "error" if (h.corrupt or h.stalled or h.rewritten) else (
        "warning" if (h.backlog_growing or h.state_growth or h.idle) else "healthy")
    if not report.exists:
        h.messages.append("no checkpoint yet: the job has never run with these settings")
    return h
