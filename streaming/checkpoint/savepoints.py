"""Savepoints, as Flink users know them: a consistent, restorable copy of a job's progress.

``savepoints/<job>/<id>/`` holds ``checkpoint/`` (a copy of the Spark checkpoint with the engine
state) and ``manifest.json``: job, code version, batch id, source position, the version of every
sink table (Iceberg snapshot id, Delta version), state shape and fingerprint, key columns, shuffle
partitions, Spark version, time, and a sequence number (newer savepoints have higher ones).

* **create** is stop-with-savepoint: a running stream is asked to stop after its current batch, then the
  savepoint takes the job's lease (``lease``: nothing else writes the checkpoint or starts the stream
  meanwhile) and copies the checkpoint. A savepoint is the state *as of the last batch Spark committed*,
  whatever the stream was doing: if it died inside a batch, after some of that batch's table commits, the
  versions recorded are those before its first commit of that batch, not the tables' current ones.
* **restore** (``lakestream run JOB --from-savepoint ID``) checks compatibility first, then, holding the
  lease: records that a restore is under way, puts the copy back as the job's checkpoint (with a new
  commit-id epoch), rolls the tables the job owns (its main table and late side output) back to their
  recorded versions (Iceberg: set the current snapshot; Delta: restore the version), and deletes from the
  tables it shares with other jobs (``lake.quarantine.<source>``) only the rows this job's stream wrote
  after the savepoint's batch; the other jobs' rows stay. The stream then continues exactly-once from the
  savepoint even if the job ran on after it. A restore that is interrupted is finished by the next process
  that takes the lease (a stream's start, or the restore run again).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from .compat import differences, refuse, stored_shuffle_partitions, stream_partitions
from ..declaration import Job, Table
from ..errors import SavepointError
from ..io.sources import kind_of
from ..spark.hadoopfs import HadoopFS
from ..spark.jvm import hadoop_copy
from .layout import Layout, commit_app_id, numbered, offset_sources, query_id
from .lease import Lease
from ..settings import Settings
from ..io.sinks import IcebergSink, sink_for
from ..io.sinks.base import FLUSH
from .records import EngineState
from ..io.tables import table_roles

MANIFEST = "manifest.json"
_ID = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)-(\d{8}T\d{6}\d{3}Z)-b(-?\d+)$")


@dataclass(frozen=True)
class Savepoint:
    id: str
    job: str
    path: str
    manifest: dict

    @property
    def checkpoint(self) -> str:
        return f"{self.path}/checkpoint"


def job_of(savepoint_id: str) -> str:
    match = _ID.match(savepoint_id)
    if not match:
        raise SavepointError(
            f"{savepoint_id!r} is not a savepoint id (they look like purchase_metrics-20261122T101500123Z-b41; "
            "see `lakestream savepoint list JOB`)"
        )
    return match.group(1)


def code_version() -> str | None:
    """The git commit of the running code, when it runs from a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


class Savepoints:
    def __init__(self, spark, settings: Settings, progress: Callable[[str], None] | None = print,
                 fault: Callable[[str, int], None] | None = None):
        """``fault``: a test's fault function (``run/faults.py``), called at ``restore:tables`` (the tables are
        rolled back, the checkpoint not swapped yet)."""
        self.spark = spark
        self.settings = settings
        self.fs = HadoopFS(spark)
        self.say = progress or (lambda _msg: None)
        self.fault = fault or (lambda point, batch_id: None)

    def folder(self, job: str) -> str:
        return f"{self.settings.savepoints.rstrip('/')}/{job}"

    def lease(self, job: Job) -> Lease:
        return Lease(self.settings.checkpoint_dir(job.name), self.settings.storage_options, job=job.name)

    # -- listing -------------------------------------------------------------------------
    def list(self, job: str) -> list[Savepoint]:
        """The job's savepoints, oldest first (by sequence: a clock that steps back does not reorder them)."""
        found = []
        for name in sorted(self.fs.list_names(self.folder(job))):
            if _ID.match(name) and self.fs.exists(f"{self.folder(job)}/{name}/{MANIFEST}"):
                found.append(self.get(name))
        return sorted(found, key=_order)

    def get(self, savepoint_id: str) -> Savepoint:
        job = job_of(savepoint_id)
        path = f"{self.folder(job)}/{savepoint_id}"
        if not self.fs.exists(f"{path}/{MANIFEST}"):
            raise SavepointError(f"no savepoint {savepoint_id} in {self.folder(job)}; `lakestream savepoint list {job}` shows them")
        try:
            manifest = json.loads(self.fs.read_text(f"{path}/{MANIFEST}"))
        except ValueError:
            raise SavepointError(f"{path}/{MANIFEST} is corrupt; delete the savepoint") from None
        return Savepoint(savepoint_id, job, path, manifest)

    def delete(self, savepoint_id: str) -> Savepoint:
        savepoint = self.get(savepoint_id)
        self._release_versions(savepoint)
        self.fs.delete(savepoint.path)
        return savepoint

    def _keep_versions(self, job: Job, savepoint_id: str, versions: dict) -> dict[str, str]:
        """Tag the Iceberg snapshots the savepoint records for its job's own tables, so that the stream's snapshot
        expiry keeps them (``{table: tag}``). A shared table's version is a note (it is not restored)."""
        tags = {}
        tag = f"lakestream-savepoint-{savepoint_id}"
        for table, role, _ in table_roles(job):
            version = versions.get(table.name)
            if role == "quarantine" or version is None:
                continue
            sink = sink_for(self.spark, self.settings, table, job.name)
            if sink.tag(version, tag):
                if sink.format == "iceberg":
                    tags[table.name] = tag
            else:
                self.say(f"  {table.name} no longer has version {version}: this savepoint cannot restore it")
        return tags

    def _release_versions(self, savepoint: Savepoint) -> None:
        """Drop the savepoint's tags (its snapshots then expire like any other)."""
        for table, tag in (savepoint.manifest.get("tags") or {}).items():
            try:
                IcebergSink(self.spark, Table(table)).untag(tag)
            except Exception as exc:  # noqa: BLE001 - a tag left behind keeps one snapshot; say so, go on
                self.say(f"  could not drop tag {tag} of {table} ({str(exc).splitlines()[0][:200]}); drop it by hand")

    def prune(self, job: str, keep: int) -> list[str]:
        """Delete all but the newest ``keep`` savepoints of ``job``; returns the deleted ids."""
        if keep < 1:
            raise SavepointError(f"--keep must be at least 1, got {keep}")
        old = self.list(job)[:-keep]
        for savepoint in old:
            self._release_versions(savepoint)
            self.fs.delete(savepoint.path)
        return [s.id for s in old]

    # -- create --------------------------------------------------------------------------
    def create(self, job: Job, *, timeout_s: float = 600.0, keep: int | None = None) -> Savepoint:
        checkpoint = self.settings.checkpoint_dir(job.name)
        layout = Layout(checkpoint)
        if not self.fs.exists(layout.metadata):
            raise SavepointError(f"{job.name} has no checkpoint at {checkpoint} yet; run it before taking a savepoint")
        lease = self.lease(job)
        self._stop_holder(job, lease, timeout_s)
        lease.acquire("savepoint")
        try:
            from ..run.side import settle_stopped

            # Side rows the stream kept in its checkpoint (a crash left them) go to their tables first, so the copy
            # and the tables' versions agree on them (``run.side``).
            settle_stopped(self.spark, self.settings, job, say=self.say)
            # The savepoint's batch is the last one Spark recorded as committed; a batch planned after it
            # (interrupted by the stop, or by a crash) is replayed after a restore, exactly-once like any other.
            committed = numbered(self.fs.list_names(layout.commits))
            batch_id = committed[-1] if committed else -1
            record = EngineState(self.spark, checkpoint).latest_record_before(batch_id + 1)
            previous = self.list(job.name)
            now = datetime.now(timezone.utc)
            savepoint_id = f"{job.name}-{now.strftime('%Y%m%dT%H%M%S')}{now.microsecond // 1000:03d}Z-b{batch_id}"
            path = f"{self.folder(job.name)}/{savepoint_id}"
            self.say(f"copying {checkpoint} -> {path}/checkpoint")
            self._copy(checkpoint, f"{path}/checkpoint")
            copy = Layout(f"{path}/checkpoint")
            for transient in (copy.running, copy.stop_request):
                self.fs.delete(transient)
            manifest = self._manifest(job, savepoint_id, checkpoint, record, batch_id, now,
                                      sequence=1 + max((_order(s)[0] for s in previous), default=0))
            manifest["tags"] = self._keep_versions(job, savepoint_id, manifest["tables"])
            self.fs.write_text(f"{path}/{MANIFEST}", json.dumps(manifest, indent=1))
        finally:
            lease.release()
        savepoint = Savepoint(savepoint_id, job.name, path, manifest)
        if keep:
            for gone in self.prune(job.name, keep):
                self.say(f"retention (keep {keep}): deleted savepoint {gone}")
        return savepoint

    def _stop_holder(self, job: Job, lease: Lease, timeout_s: float) -> None:
        """Ask whoever holds the job's lease to stop after its batch, and wait until it has given the lease back
        (or died: a holder on another host counts as dead once it has not renewed for the lease's ttl)."""
        holder = lease.holder()
        if holder is None:
            return
        self.say(f"{job.name} is held ({holder.describe()}): asking it to stop after its current batch")
        lease.request_stop(holder)
        deadline = time.monotonic() + timeout_s
        next_note = time.monotonic() + 10
        while (current := lease.holder()) is not None and current.generation == holder.generation:
            if time.monotonic() > deadline:
                raise SavepointError(
                    f"{job.name} did not stop within {timeout_s:.0f}s ({current.describe()}); its batch may be long: "
                    "retry with a larger --timeout")
            if time.monotonic() > next_note:
                self.say(f"  still waiting for {job.name} to finish its batch...")
                next_note += 10
            time.sleep(0.5)
        self.say(f"{job.name} stopped")

    def _copy(self, source: str, target: str) -> None:
        if self.fs.exists(target):
            raise SavepointError(f"{target} already exists")
        self.fs.mkdirs(target.rsplit("/", 1)[0])
        if not hadoop_copy(self.spark, source, target):
            raise SavepointError(f"could not copy {source} to {target}")

    def _manifest(self, job: Job, savepoint_id: str, checkpoint: str, record, batch_id: int, now: datetime, *,
                  sequence: int) -> dict:
        layout = Layout(checkpoint)
        offsets = numbered(self.fs.list_names(layout.offsets))
        committed = layout.offset(batch_id) if batch_id >= 0 else None
        source_offset = offset_sources(self.fs.read_text(committed), committed) if committed else None
        app = commit_app_id(self.fs, layout)
        tables = {}
        for table, role, _ in table_roles(job):
            sink = sink_for(self.spark, self.settings, table, job.name)
            # The job's own tables as of the savepoint's batch (a batch after it may have committed some of its
            # tables before a crash); a shared table is not rolled back (see restore), its version is a note.
            tables[table.name] = sink.version_before(app, batch_id, flush_kept=bool(record and record.pending)) \
                if role != "quarantine" else sink.version()
        return {
            "id": savepoint_id,
            "job": job.name,
            "sequence": sequence,
            "created": now.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "created_ms": int(now.timestamp() * 1000),
            "code_version": code_version(),
            "batch_id": batch_id if batch_id >= 0 else None,
            "query_id": app.split(":", 1)[0],
            "app_id": app,
            "side_rows_kept": bool(record and record.pending),  # (see ``run.side``: none once settled)
            "watermark_ms": record.watermark_ms if record else None,
            "source": {"landing": [kind_of(s).location(self.settings, s) for s in job.sources], "offsets": source_offset,
                       "last_planned_batch": offsets[-1] if offsets else None},
            "format": self.settings.format_of(job.name),
            "tables": tables,
            "state": {"fingerprint": job.fingerprint(), "shape": job.shape()},
            "keys": list(job.keys),
            "shuffle_partitions": stored_shuffle_partitions(self.fs, checkpoint),
            "spark_version": self.spark.version,
        }

    # -- restore -------------------------------------------------------------------------
    def restore(self, job: Job, savepoint_id: str, lease: Lease | None = None) -> Savepoint:
        """Make the job's checkpoint and tables what they were at the savepoint (see the module).

        ``lease``: the job's lease, already held by the caller (a stream that restores before it starts);
        else the restore takes it, and refuses in one line while a stream or another restore holds it. Every
        check that can refuse the restore runs before anything is changed, so a refused restore leaves
        checkpoint and tables exactly as they were."""
        own = lease is None
        lease = lease or self.lease(job).acquire("restore")
        try:
            savepoint, checkpoint, rollbacks, shared = self._restore_plan(job, savepoint_id)
            lease.begin_restore(savepoint_id)  # (an interruption from here on is finished by the next taker)
            # 1. the copy, beside the checkpoint (nothing of the job changes yet)
            staged = f"{checkpoint}.restoring"
            self.fs.delete(staged)
            self.say(f"restoring checkpoint {checkpoint} from {savepoint.checkpoint}")
            self._copy(savepoint.checkpoint, staged)
            # A new commit-id epoch: batches re-run from here must not match the commits rolled back below.
            restored_at = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
            self.fs.write_text(Layout(staged).epoch, f"restored-{savepoint_id}-{restored_at}")
            # 2. the tables: the job's own ones back to their versions; from the shared ones, this job's rows
            #    written after the savepoint's batch (every commit of the stream carries its batch)
            for sink, version in rollbacks:
                if version is None:
                    self.say(f"  {sink.table.name}: empty at the savepoint -> deleting all rows")
                elif sink.version() != version:
                    self.say(f"  {sink.table.name}: rolling back to version {version}")
                sink.rollback(version)
            batch_id = savepoint.manifest.get("batch_id")
            query = savepoint.manifest.get("query_id") or _query_of(self.fs, savepoint.checkpoint)
            for sink in shared:
                self.say(f"  {sink.table.name} (shared): deleting {job.name}'s rows written after batch {batch_id}")
                after = f"batch_id > {-1 if batch_id is None else int(batch_id)}"
                if savepoint.manifest.get("side_rows_kept") and batch_id is not None:
                    # the copy keeps side rows that a commit outside a batch may have written after it (run.side)
                    after = f"({after} OR written_by = '{savepoint.manifest.get('app_id')}{FLUSH}:{int(batch_id)}')"
                sink.delete_where(f"detected_by = '{job.name}' AND written_by LIKE '{query}%' AND {after}")
            self.fault("restore:tables", int(batch_id if batch_id is not None else -1))
            # 3. the checkpoint
            self.fs.delete(checkpoint)
            self.fs.rename(staged, checkpoint)
            lease.end_restore()
        finally:
            if own:
                lease.release()
        return savepoint

    def _restore_plan(self, job: Job, savepoint_id: str):
        """(savepoint, checkpoint, [(own sink, version)], [shared sink]), or the reason the restore is refused."""
        savepoint = self.get(savepoint_id)
        if savepoint.job != job.name:
            raise SavepointError(f"savepoint {savepoint_id} belongs to job {savepoint.job}, not {job.name}")
        manifest = savepoint.manifest
        partitions = stream_partitions(self.spark, job, manifest.get("shuffle_partitions"))
        checkpoint = self.settings.checkpoint_dir(job.name)
        changes = differences(manifest.get("state", {}).get("shape"), manifest.get("shuffle_partitions"), job, partitions)
        if changes:
            raise refuse(job, f"savepoint {savepoint_id}", changes, checkpoint)
        fmt = manifest.get("format", "iceberg")
        if fmt != self.settings.format_of(job.name):
            raise SavepointError(
                f"savepoint {savepoint_id} recorded {fmt} tables but {job.name} is configured for "
                f"{self.settings.format_of(job.name)}; set the job's format back to {fmt} to restore it"
            )
        if not self.fs.exists(Layout(savepoint.checkpoint).metadata):
            raise SavepointError(f"savepoint {savepoint_id} has no checkpoint copy at {savepoint.checkpoint} "
                                 "(incomplete or damaged); choose another one (`lakestream savepoint list`)")
        roles = {t.name: role for t, role, _ in table_roles(job)}
        rollbacks, shared = [], []
        for name, version in manifest.get("tables", {}).items():
            sink = sink_for(self.spark, self.settings, Table(name), job.name)
            if roles.get(name, "quarantine") == "quarantine":
                if sink.exists():
                    shared.append(sink)
                continue
            if not sink.exists():
                if version is not None:
                    raise SavepointError(
                        f"savepoint {savepoint_id} needs {name} at version {version}, but the table no longer exists; "
                        "the restore would lose its rows: restore the table first, or start over from an empty checkpoint"
                    )
                continue
            if version is not None and not sink.has_version(version):
                raise SavepointError(
                    f"{name} no longer has version {version}, which savepoint {savepoint_id} recorded (its snapshots "
                    "were expired or vacuumed); choose a newer savepoint, and keep snapshots newer than the oldest one"
                )
            rollbacks.append((sink, version))
        return savepoint, checkpoint, rollbacks, shared


def _order(savepoint: Savepoint) -> tuple[int, int]:
    """Savepoints by sequence (then creation time, for those made before sequences were recorded)."""
    return int(savepoint.manifest.get("sequence") or 0), int(savepoint.manifest.get("created_ms") or 0)


def _query_of(fs, checkpoint: str) -> str:
    return query_id(fs.read_text(Layout(checkpoint).metadata))
