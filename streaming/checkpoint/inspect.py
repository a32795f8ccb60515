"""Read a job's Spark checkpoint in pure Python (no JVM): fast enough for a sensor every 30 s.

What Spark keeps in a streaming checkpoint folder, and what is read from it:

    metadata               {"id": <query id>}
    offsets/N              "v1", batch metadata (watermark, timestamp, conf), one offset per source
                           -> batch N is *planned* (its input is fixed)
    commits/N              "v1", {"nextBatchWatermarkMs": ...}  -> batch N is *committed*
    sources/<i>/N[.compact] file source log: one JSON line per input file, with its batchId
    state/<op>/<part>/...  state store versions of Spark's stateful operators
    lakestream/            the engine's own state (batch records with the event-time watermark)

Nothing here raises on a damaged checkpoint: unreadable files are listed in ``problems`` and make
the health ``error`` (``corrupt``).
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Mapping
from urllib.parse import unquote, urlparse

import fsspec
from fsspec.implementations.local import LocalFileSystem

from . import layout as spark_logs
from .layout import Layout

if TYPE_CHECKING:
    from ..declaration import Job
    from ..settings import Settings

_STATE_VERSION = re.compile(r"^(\d+)\.(delta|snapshot|zip|changelog)$")
LAYOUT = Layout("")  # paths relative to the checkpoint folder
_NEG_INF_MS = -(2**62)
_POS_INF_MS = 2**62


@dataclass
class Thresholds:
    """When the derived health flags turn on."""

    trigger_interval_s: float = 10.0
    stall_factor: float = 5.0  # stalled: no commit for stall_factor x trigger interval while input waits ...
    stall_batches: float = 3.0  # ... and for this many times the longest recent batch (slow batches are not stalls)
    state_growth_ratio: float = 1.5  # state growth: rows remembered > ratio x after the previous batch ...
    state_growth_min_rows: int = 100_000  # ... and more than this


@dataclass
class StateOperator:
    operator: str
    partitions: int
    latest_version: int | None
    bytes: int


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


@dataclass
class CheckpointReport:
    job: str
    path: str
    exists: bool
    inspected_at_ms: int
    query_id: str | None = None
    last_planned_batch: int | None = None
    last_committed_batch: int | None = None
    last_commit_ms: int | None = None
    recent_batch_seconds: list[float] = field(default_factory=list)  # planned -> committed, newest batches last
    in_flight_batch: int | None = None
    files_consumed: int = 0
    consumed_files: list[str] = field(default_factory=list, repr=False)  # real paths, for reconciliation
    files_in_flight: int = 0
    files_waiting: int = 0
    bytes_waiting: int = 0
    oldest_waiting_ms: int | None = None
    shuffle_partitions: int | None = None
    watermark_ms: int | None = None  # the engine's event-time watermark after the last committed batch
    state_operators: list[StateOperator] = field(default_factory=list)
    state_bytes: int = 0  # Spark state stores + the engine's incremental store, on disk
    state_rows: dict | None = None  # what the stream remembers after its last batch (ids, pieces, evals / keys)
    engine_state_rows: dict[int, int] = field(default_factory=dict)  # batch id -> rows remembered after it
    totals: dict | None = None  # the stream's cumulative statistics after the last committed batch (lines, late...)
    rewritten_files: list[str] = field(default_factory=list)  # landing files modified after the stream read them
    table_offsets: list[dict] = field(default_factory=list)  # table sources: the snapshot read up to (Iceberg offsets)
    running: dict | None = None  # the marker of the process running the stream (pid, host, query id, start)
    problems: list[str] = field(default_factory=list)
    health: Health = field(default_factory=Health)

    def to_dict(self) -> dict:
        data = asdict(self)
        data.pop("consumed_files")
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


class Tree:
    """Read-only access to a folder on any file system fsspec knows, without a JVM: local paths and
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
        try:
            return list(self.fs.ls(self.path(*parts), detail=True))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def names(self, *parts: str) -> list[str]:
        return [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in self.entries(*parts)]

    def read_text(self, *parts: str) -> str:
        return self.fs.cat_file(self.path(*parts)).decode("utf-8")

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


def live_marker(info: Any) -> dict | None:
    """A stream's running marker, or None when it is unreadable or its process is gone (known on this host only)."""
    if not isinstance(info, dict):
        return None
    if info.get("host") == socket.gethostname():
        try:
            os.kill(int(info["pid"]), 0)
        except (ProcessLookupError, ValueError, KeyError, TypeError):
            return None
        except PermissionError:
            pass  # alive, owned by someone else
    return info


def _read_running(root: Tree, report: CheckpointReport) -> None:
    try:
        report.running = live_marker(json.loads(root.read_text("lakestream/running")))
    except (OSError, UnicodeDecodeError, ValueError):
        report.running = None  # no marker (or one being rewritten): not running


def _text(tree: Tree, rel: str, problems: list[str]) -> str | None:
    try:
        return tree.read_text(rel)
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(f"{rel} is unreadable: {getattr(exc, 'strerror', None) or exc}")
        return None


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


def inspect_checkpoint(
    job: str,
    checkpoint: str,
    landing: str | list[str] | None = None,
    thresholds: Thresholds | None = None,
    now_ms: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> CheckpointReport:
    """Inspect ``checkpoint`` (and the job's ``landing`` folder(s), for the backlog). Never raises on bad files.

    ``storage_options`` go to fsspec for checkpoints and landing folders on object stores."""
    limits = thresholds or Thresholds()
    now = now_ms if now_ms is not None else time.time_ns() // 1_000_000
    try:
        root = Tree(checkpoint, storage_options)
    except ValueError as exc:
        report = CheckpointReport(job=job, path=checkpoint, exists=False, inspected_at_ms=now, problems=[str(exc)])
        report.health = Health(status="error", corrupt=True, messages=[str(exc)])
        return report
    report = CheckpointReport(job=job, path=root.root if root.local else checkpoint, exists=root.isdir(),
                              inspected_at_ms=now)
    problems = report.problems
    if report.exists:
        _read_metadata(root, report)
        _read_offsets_and_commits(root, report)
        consumed, in_flight = _read_source_log(root, report)
        _read_state(root, report)
        _read_engine_state(root, report)
        _read_running(root, report)
    else:
        consumed, in_flight = {}, set()
    if landing is not None:
        try:
            folders = [landing] if isinstance(landing, str) else landing
            files: dict[str, tuple[int, int]] = {}
            for folder in folders:
                files.update(landing_files(folder, storage_options))
            waiting = {p: v for p, v in files.items() if p not in consumed}
        except (ValueError, OSError) as exc:
            problems.append(str(exc))
            files, waiting = {}, {}
        report.files_consumed = len(consumed)
        report.consumed_files = sorted(consumed)
        # A file changed after the stream read it: Spark never reads a path twice, so what changed is lost
        # to the stream (and shows up in reconciliation); its source log recorded the modification time.
        report.rewritten_files = sorted(
            p for p, entry in consumed.items() if p in files and entry.modified_ms and files[p][1] != entry.modified_ms)
        report.files_in_flight = len([p for p in waiting if p in in_flight])
        waiting = {p: v for p, v in waiting.items() if p not in in_flight}
        report.files_waiting = len(waiting)
        report.bytes_waiting = sum(size for size, _ in waiting.values())
        report.oldest_waiting_ms = min((mtime for _, mtime in waiting.values()), default=None)
    report.health = _health(report, limits, root)
    return report


def job_thresholds(settings: Settings, job: Job) -> Thresholds:
    return Thresholds(trigger_interval_s=settings.job(job.name).trigger_interval.total_seconds())


def inspect_job(settings: Settings, job: Job, thresholds: Thresholds | None = None,
                now_ms: int | None = None) -> CheckpointReport:
    """``inspect_checkpoint`` of a declared job: its checkpoint, the landing folders of its sources,
    the settings' storage options, and thresholds from its trigger interval unless given."""
    return inspect_checkpoint(job.name, settings.checkpoint_dir(job.name),
                              [settings.landing_dir(s) for s in job.sources if not s.is_table],
                              thresholds or job_thresholds(settings, job), now_ms,
                              settings.storage_options)


def _read_metadata(root: Tree, report: CheckpointReport) -> None:
    if not root.exists(LAYOUT.metadata):
        report.problems.append("metadata is missing (the query never started, or the folder is damaged)")
        return
    text = _text(root, LAYOUT.metadata, report.problems)
    if text is not None:
        try:
            report.query_id = spark_logs.query_id(text)
        except ValueError as exc:
            report.problems.append(str(exc))


def _read_offsets_and_commits(root: Tree, report: CheckpointReport) -> None:
    planned = spark_logs.numbered(root.names(LAYOUT.offsets))
    committed = spark_logs.numbered(root.names(LAYOUT.commits))
    if planned:
        n = report.last_planned_batch = planned[-1]
        text = _text(root, LAYOUT.offset(n), report.problems)
        if text is not None:
            try:
                report.shuffle_partitions = spark_logs.shuffle_partitions(spark_logs.offset_metadata(text, LAYOUT.offset(n)))
            except ValueError as exc:
                report.problems.append(str(exc))
    if committed:
        n = report.last_committed_batch = committed[-1]
        text = _text(root, LAYOUT.commit(n), report.problems)
        if text is not None:
            try:
                spark_logs.commit_watermark(text, LAYOUT.commit(n))
            except ValueError as exc:
                report.problems.append(str(exc))
            report.last_commit_ms = root.mtime_ms(LAYOUT.commit(n))
        offset = _text(root, LAYOUT.offset(n), report.problems) if root.exists(LAYOUT.offset(n)) else None
        try:  # a table source's offset names the snapshot the stream has read up to
            report.table_offsets = [o for o in spark_logs.offset_sources(offset, LAYOUT.offset(n))
                                    if spark_logs.is_table_offset(o)] if offset else []
        except ValueError:
            pass
        for b in committed[-10:]:  # how long batches take: offset-log entry (planned) -> commit-log entry
            try:
                report.recent_batch_seconds.append(
                    max(0.0, (root.mtime_ms(LAYOUT.commit(b)) - root.mtime_ms(LAYOUT.offset(b))) / 1000))
            except OSError:
                pass
    if report.last_planned_batch is not None and (
        report.last_committed_batch is None or report.last_planned_batch > report.last_committed_batch
    ):
        report.in_flight_batch = report.last_planned_batch
    if (
        report.last_committed_batch is not None
        and report.last_planned_batch is not None
        and report.last_committed_batch > report.last_planned_batch
    ):
        report.problems.append(
            f"commits/{report.last_committed_batch} has no offsets entry (last planned batch is "
            f"{report.last_planned_batch}): the offset log was damaged"
        )


def _read_source_log(root: Tree, report: CheckpointReport) -> tuple[dict[str, spark_logs.SourceFile], set[str]]:
    """(files of committed batches, files of batches not yet committed), keyed as file_key names them."""
    consumed: dict[str, spark_logs.SourceFile] = {}
    pending: set[str] = set()
    committed = report.last_committed_batch if report.last_committed_batch is not None else -1
    for source in sorted(root.names(LAYOUT.sources)):
        folder = f"{LAYOUT.sources}/{source}"
        for name in spark_logs.source_log_files(root.names(folder)):
            rel = f"{folder}/{name}"
            text = _text(root, rel, report.problems)
            if text is None:
                continue
            try:
                entries = spark_logs.source_log_entries(text, rel, int(name.split(".")[0]))
            except ValueError as exc:
                report.problems.append(str(exc))
                continue
            for entry in entries:
                if entry.batch_id <= committed:
                    consumed[file_key(entry.path)] = entry
                else:
                    pending.add(file_key(entry.path))
    return consumed, pending - set(consumed)


def _read_state(root: Tree, report: CheckpointReport) -> None:
    for operator in sorted(root.names(LAYOUT.state)):
        folder = f"{LAYOUT.state}/{operator}"
        if not root.isdir(folder):
            continue
        partitions = [p for p in root.names(folder) if p.isdigit()]
        versions = [int(m.group(1)) for p in partitions for n in root.names(f"{folder}/{p}")
                    if (m := _STATE_VERSION.match(n))]
        size = root.bytes_below(folder)
        report.state_operators.append(StateOperator(operator, len(partitions), max(versions, default=None), size))
        report.state_bytes += size


def _read_engine_state(root: Tree, report: CheckpointReport) -> None:
    """The engine's batch records: the watermark, the totals and what the stream remembers after
    each recorded batch (rows of the incremental store, or keys with keyed state)."""
    layout = Layout("")
    ids = sorted(int(n[:-5]) for n in root.names(layout.batches) if n.endswith(".json") and n[:-5].isdigit())
    for batch in ids:
        try:
            rows = json.loads(root.read_text(layout.record(batch))).get("state_rows") or {}
            report.engine_state_rows[batch] = int(sum(rows.values()))
        except (OSError, UnicodeDecodeError, ValueError, AttributeError, TypeError):
            pass  # reported below if it is the newest record
    report.state_bytes += root.bytes_below(layout.store)
    committed = [b for b in ids if report.last_committed_batch is None or b <= report.last_committed_batch]
    newest = committed[-1] if committed else (ids[-1] if ids else None)
    if newest is None:
        return
    rel = layout.record(newest)
    try:
        record = json.loads(root.read_text(rel))
        report.watermark_ms = int(record["stats"]["watermark_out_ms"])
        report.totals = record.get("totals")
        report.state_rows = record.get("state_rows")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        report.problems.append(f"{rel} is corrupt: no watermark")


def _age(now_ms: int, then_ms: int | None) -> str:
    if then_ms is None:
        return "never"
    seconds = max(0, now_ms - then_ms) / 1000
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}min ago"


def _health(report: CheckpointReport, limits: Thresholds, root: Tree) -> Health:
    h = Health()
    now = report.inspected_at_ms
    if report.problems:
        h.corrupt = True
        h.messages += [f"corrupt: {p}" for p in report.problems]
    if report.in_flight_batch is not None:
        h.in_flight = True
        h.messages.append(f"batch {report.in_flight_batch} is planned but not committed (running, or to be replayed)")
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
        if overdue and report.running is None and report.in_flight_batch is None:
            h.idle = True
            h.messages.append(
                f"idle: {report.files_waiting} file(s) wait (the oldest since {_age(now, report.oldest_waiting_ms)}) and "
                f"no stream of {report.job} runs; start it (`lakestream run {report.job}`, or launch "
                f"{report.job}_stream in Dagster) when the data is wanted")
        elif overdue:
            h.stalled = True
            basis = (f"{limits.stall_factor:g} x {limits.trigger_interval_s:g}s trigger interval"
                     if limit_ms == limits.stall_factor * limits.trigger_interval_s * 1000
                     else f"{limits.stall_batches:g} x its longest recent batch, {longest:.0f}s")
            h.messages.append(
                f"stalled: last commit {_age(now, report.last_commit_ms)} while {report.files_waiting} file(s) wait "
                f"(limit {limit_ms / 1000:.0f}s: {basis})"
            )
        if report.last_commit_ms is not None and report.oldest_waiting_ms is not None:
            if report.oldest_waiting_ms < report.last_commit_ms - limits.trigger_interval_s * 1000:
                h.backlog_growing = True
                h.messages.append(
                    f"backlog: {report.files_waiting} file(s) ({report.bytes_waiting:,} bytes) wait, the oldest since "
                    f"{_age(now, report.oldest_waiting_ms)}, though batches committed after it arrived: input arrives "
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


def _process(report: CheckpointReport) -> str:
    r = report.running
    if r is None:
        return "none running"
    return f"pid {r.get('pid')} on {r.get('host')}, started {_age(report.inspected_at_ms, r.get('started_ms'))}"


def state_of(report: CheckpointReport) -> str:
    if report.running is not None:
        return "running"
    return "stopped" if report.exists else "never run"


def status_table(reports: list[CheckpointReport]) -> str:
    """Every job on one line (``lakestream status``), then what its health says when not healthy."""
    from ..durations import from_epoch_ms, iso_ms

    def watermark(ms: int | None) -> str:
        if ms is None or ms <= _NEG_INF_MS:
            return "-"
        return "+inf" if ms >= _POS_INF_MS else iso_ms(from_epoch_ms(ms))

    rows = [("job", "state", "batch", "last commit", "waiting", "watermark", "health")]
    for r in reports:
        rows.append((
            r.job,
            state_of(r) + (f" (pid {r.running.get('pid')})" if r.running else ""),
            "-" if r.last_committed_batch is None else str(r.last_committed_batch),
            _age(r.inspected_at_ms, r.last_commit_ms) if r.last_commit_ms is not None else "-",
            f"{r.files_waiting} file(s)",
            watermark(r.watermark_ms),
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
    from ..durations import from_epoch_ms, iso_ms

    def when(ms: int | None) -> str:
        return "-" if ms is None else f"{iso_ms(from_epoch_ms(ms))} ({_age(report.inspected_at_ms, ms)})"

    def watermark(ms: int | None) -> str:
        if ms is None or ms <= _NEG_INF_MS:
            return "-inf (no events yet)" if ms is not None else "-"
        return "+inf (end of input)" if ms >= _POS_INF_MS else iso_ms(from_epoch_ms(ms))

    lines = [
        f"job              {report.job}",
        f"checkpoint       {report.path}{'' if report.exists else ' (missing)'}",
        f"query id         {report.query_id or '-'}",
        f"last planned     {'-' if report.last_planned_batch is None else report.last_planned_batch}",
        f"last committed   {'-' if report.last_committed_batch is None else report.last_committed_batch}"
        f" at {when(report.last_commit_ms)}",
        f"in flight        {'-' if report.in_flight_batch is None else f'batch {report.in_flight_batch}'}",
        f"process          {_process(report)}",
        *([f"source tables    read up to snapshot(s) "
           + ", ".join(str(o["snapshot_id"]) for o in report.table_offsets)]
          if report.table_offsets else []),
        f"source files     {report.files_consumed} consumed, {report.files_in_flight} in flight, "
        f"{report.files_waiting} waiting ({report.bytes_waiting:,} bytes)",
        f"watermark        {watermark(report.watermark_ms)}",
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
