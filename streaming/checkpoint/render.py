"""A checkpoint report for people: ``lakestream checkpoint inspect`` and ``lakestream status``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .health import age

if TYPE_CHECKING:
    from .inspect import CheckpointReport


def _process(report: CheckpointReport) -> str:
    r = report.running
    if r is None:
        return "none running"
    what = "" if r.get("purpose", "stream") == "stream" else f"{r.get('purpose')} "
    return f"{what}pid {r.get('pid')} on {r.get('host')}, started {age(report.inspected_at_ms, r.get('started_ms'))}"


def state_of(report: CheckpointReport) -> str:
    if report.running is not None:
        return "running"
    return "stopped" if report.exists else "never run"


def status_table(reports: list[CheckpointReport]) -> str:
    """Every job on one line (``lakestream status``), then what its health says when not healthy."""
    from ..time import short_watermark

    rows = [("job", "state", "batch", "last commit", "waiting", "watermark", "health")]
    for r in reports:
        rows.append((
            r.job,
            state_of(r) + (f" (pid {r.running.get('pid')})" if r.running else ""),
            "-" if r.last_committed_batch is None else str(r.last_committed_batch),
            age(r.inspected_at_ms, r.last_commit_ms) if r.last_commit_ms is not None else "-",
            f"{r.files_waiting} file(s)",
            short_watermark(r.watermark_ms),
            r.health.status.upper() if r.health.status != "healthy" else "healthy",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    for r in reports:
        if r.health.status != "healthy":
            lines += [f"  {r.job}: {m}" for m in r.health.messages]
    return "\n".join(lines)


def describe(report: CheckpointReport) -> str:
    """A human-readable report (the CLI's default output)."""
    from ..time import describe_watermark, from_epoch_ms, iso_ms

    def when(ms: int | None) -> str:
        return "-" if ms is None else f"{iso_ms(from_epoch_ms(ms))} ({age(report.inspected_at_ms, ms)})"

    def watermark(ms: int | None) -> str:
        return "-" if ms is None else describe_watermark(ms)

    lines = [
        f"job              {report.job}",
        f"checkpoint       {report.path}{'' if report.exists else ' (missing)'}",
        f"query id         {report.query_id or '-'}",
        f"last planned     {'-' if report.last_planned_batch is None else report.last_planned_batch}",
        f"last committed   {'-' if report.last_committed_batch is None else report.last_committed_batch}"
        f" at {when(report.last_commit_ms)}",
        f"in flight        {'-' if report.in_flight_batch is None else f'batch {report.in_flight_batch}'}",
        f"process          {_process(report)}",
        *([f"source positions {', '.join(f'{name}: {at}' for name, at in report.positions.items())}"]
          if report.positions else []),
        f"source files     {report.files_consumed} consumed, {report.files_in_flight} in flight, "
        f"{report.files_waiting} waiting ({report.bytes_waiting:,} bytes)",
        f"watermark        {watermark(report.watermark_ms)}",
        *([f"side rows kept   {', '.join(f'{t}: {n:,}' for t, n in sorted(report.side_rows_kept.items()))} "
           "(committed at the next interval or stop)"] if report.side_rows_kept else []),
        f"shuffle parts    {report.shuffle_partitions or '-'}",
        f"state on disk    {report.state_bytes:,} bytes"
        + "".join(
            f"\n  operator {o.operator}: {o.partitions} partitions, version {o.latest_version}, {o.bytes:,} bytes"
            for o in report.state_operators
        )
        + "".join(f"\n  remembered after batch {b}: {n:,} rows" for b, n in sorted(report.engine_state_rows.items())),
        f"health           {report.health.status.upper()}",
    ]
    lines += [f"  - {m}" for m in report.health.messages]
    return "\n".join(lines)
