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
import re
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from . import layout as spark_logs
from .health import Health, Thresholds, assess, job_thresholds
from .layout import Layout
from .lease import Lease, legacy_marker
from .tree import Tree, file_key, landing_files

if TYPE_CHECKING:
    from ..declaration import Job
    from ..settings import Settings

_STATE_VERSION = re.compile(r"^(\d+)\.(delta|snapshot|zip|changelog)$")
LAYOUT = Layout("")  # paths relative to the checkpoint folder


@dataclass
class StateOperator:
    operator: str
    partitions: int
    latest_version: int | None
    bytes: int


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
    side_rows_kept: dict[str, int] = field(default_factory=dict)  # side table -> rows kept in the checkpoint (run.side)
    rewritten_files: list[str] = field(default_factory=list)  # landing files modified after the stream read them
    source_offsets: list = field(default_factory=list)  # Spark's per-source offsets of the last committed batch
    positions: dict[str, str] = field(default_factory=dict)  # source -> where the stream stands in it (e.g. a snapshot)
    running: dict | None = None  # the marker of the process running the stream (pid, host, query id, start)
    died: bool = False  # the last process to hold the lease did not give it back (a crash), none runs now
    problems: list[str] = field(default_factory=list)
    health: Health = field(default_factory=Health)

    def to_dict(self) -> dict:
        data = asdict(self)
        data.pop("consumed_files")
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


def _read_running(root: Tree, checkpoint: str, storage_options, report: CheckpointReport) -> None:
    """Who holds the checkpoint's lease, if a live process does (a stream; or a savepoint, a restore...)."""
    try:
        last = Lease(checkpoint, storage_options).current()
    except (OSError, ValueError):
        last = None
    holder = last if last is not None and last.alive() else None
    report.died = last is not None and holder is None
    if holder is not None:
        report.running = {"pid": holder.pid, "host": holder.host, "started_ms": holder.since_ms,
                          "renewed_ms": holder.renewed_ms, "purpose": holder.purpose, "generation": holder.generation}
    else:
        report.running = legacy_marker(root)  # a stream of an earlier lakestream (no lease)


def _text(tree: Tree, rel: str, problems: list[str]) -> str | None:
    try:
        return tree.read_text(rel)
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(f"{rel} is unreadable: {getattr(exc, 'strerror', None) or exc}")
        return None


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
        _read_running(root, checkpoint, storage_options, report)
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
    report.health = assess(report, limits, root)
    return report


def inspect_job(settings: Settings, job: Job, thresholds: Thresholds | None = None,
                now_ms: int | None = None) -> CheckpointReport:
    """``inspect_checkpoint`` of a declared job: its checkpoint, the landing folders of its sources,
    the settings' storage options, and thresholds from its trigger interval unless given."""
    from ..io.sources import kind_of, positions

    folders = [folder for s in job.sources if (folder := kind_of(s).landing_folder(settings, s))]
    report = inspect_checkpoint(job.name, settings.checkpoint_dir(job.name), folders,
                                thresholds or job_thresholds(settings, job), now_ms, settings.storage_options)
    by_name = {s.name: s for s in job.sources}
    report.positions = {name: kind_of(by_name[name]).describe_position(p)
                        for name, p in positions(job, report.source_offsets).items()}
    return report


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
        try:  # (a source with a position, e.g. a table's snapshot, says it here: see inspect_job)
            report.source_offsets = spark_logs.offset_sources(offset, LAYOUT.offset(n)) if offset else []
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
        for kept in record.get("pending") or ():
            report.side_rows_kept[kept["table"]] = report.side_rows_kept.get(kept["table"], 0) + int(kept["rows"])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        report.problems.append(f"{rel} is corrupt: no watermark")

