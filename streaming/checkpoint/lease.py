"""One writer per checkpoint: the lease, and the requests addressed to its holder.

Whatever writes a job's checkpoint or rolls its tables back — a stream, a savepoint, a restore, a
backfill over windows the stream holds open — first takes the job's lease, and gives it back when done.
A second taker is refused in one line that names the holder (host, pid, since when). The lease lives
beside the checkpoint, in ``<checkpoint>.control/`` (a restore replaces the checkpoint folder whole):

    lease-<generation>.json   the holder: host, pid (and when that process started), purpose, since, renewed
    stop-<generation>         asks the holder of that generation to stop after its current batch
    restore.json              a restore under way: the savepoint it restores (finished by the next taker)

Taking the lease is an exclusive create of ``lease-<g+1>`` over the highest generation ``g`` present, so
of two takers exactly one wins, on local disks and on object stores alike (a hard link locally; an
``If-None-Match`` put through s3fs on S3). The holder renews its file every ``ttl / 6``; a holder is dead
when its process is gone (on this host: the pid, and the pid's start time, so a reused pid is not taken for
the holder) or when it has not renewed for ``ttl`` (another host: a crashed pod). A dead holder's lease is
taken over by the next taker, with a new generation. A holder that finds a higher generation than its own,
or that could not renew for ``ttl``, has lost the lease and must not commit (``LeaseLostError``). Hosts'
clocks are assumed to agree to within a small fraction of the ``ttl`` (60 s by default).
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from ..errors import LeaseHeldError, LeaseLostError
from .tree import Tree

TTL_MS = 60_000
_LEASE = re.compile(r"^lease-(\d{12})\.json$")


def control_dir(checkpoint: str) -> str:
    """The folder beside a checkpoint that holds its lease and the requests to its holder."""
    return checkpoint.rstrip("/") + ".control"


def pid_start_of(pid: int) -> str | None:
    """When process ``pid`` started (Linux: clock ticks since boot), to tell it from a later process that
    reuses its pid; None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def process_alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by someone else
    except (OverflowError, ValueError):
        return False
    return started is None or pid_start_of(pid) in (None, started)


@dataclass(frozen=True)
class Holder:
    """Who holds a checkpoint's lease (the content of ``lease-<generation>.json``)."""

    generation: int
    host: str
    pid: int
    purpose: str  # stream | savepoint | restore | backfill
    since_ms: int
    renewed_ms: int
    ttl_ms: int = TTL_MS
    pid_start: str | None = None
    query_id: str | None = None

    def alive(self, now_ms: int | None = None) -> bool:
        """On this host: its process still runs; elsewhere: it renewed within its ttl."""
        if self.host == socket.gethostname():
            return process_alive(self.pid, self.pid_start)
        now = int(time.time() * 1000) if now_ms is None else now_ms
        return now - self.renewed_ms <= self.ttl_ms

    def describe(self, now_ms: int | None = None) -> str:
        from ..time import from_epoch_ms, iso_ms

        now = int(time.time() * 1000) if now_ms is None else now_ms
        return (f"{self.purpose} by pid {self.pid} on {self.host} since {iso_ms(from_epoch_ms(self.since_ms))} "
                f"(renewed {max(0, now - self.renewed_ms) / 1000:.0f} s ago)")


class Lease:
    """The lease of one job's checkpoint (see the module)."""

    def __init__(self, checkpoint: str, storage_options: Mapping[str, Any] | None = None, *, job: str | None = None,
                 ttl_ms: int = TTL_MS):
        self.checkpoint = checkpoint
        self.job = job or checkpoint.rstrip("/").rsplit("/", 1)[-1]
        self.storage_options = storage_options
        self.tree = Tree(control_dir(checkpoint), storage_options)
        self.ttl_ms = ttl_ms
        self.mine: Holder | None = None
        self._valid_until_ms = 0
        self._renewer: threading.Thread | None = None
        self._stopping = threading.Event()
        self._lost: str | None = None

    # -- reading --------------------------------------------------------------------------------
    def _generations(self) -> list[int]:
        return sorted(int(m.group(1)) for name in self.tree.names() if (m := _LEASE.match(name)))

    def _read(self, generation: int) -> Holder | None:
        try:
            return Holder(**json.loads(self.tree.read_text(f"lease-{generation:012d}.json")))
        except (OSError, ValueError, TypeError):
            return None  # (gone meanwhile, or being written)

    def current(self) -> Holder | None:
        """The holder of the highest generation, alive or not (None: nobody ever took the lease, or it was
        given back)."""
        generations = self._generations()
        return self._read(generations[-1]) if generations else None

    def holder(self) -> Holder | None:
        """The live holder, if any."""
        current = self.current()
        return current if current is not None and current.alive() else None

    # -- taking and giving back ------------------------------------------------------------------
    def acquire(self, purpose: str, *, query_id: str | None = None) -> "Lease":
        """Take the lease for ``purpose`` or raise ``LeaseHeldError`` naming the live holder."""
        legacy = legacy_marker(Tree(self.checkpoint, self.storage_options))
        if legacy is not None:
            raise LeaseHeldError(f"{self.job} is run by an earlier lakestream (pid {legacy.get('pid')} on "
                                 f"{legacy.get('host')}); stop it first")
        for _ in range(3):
            generations = self._generations()
            top = generations[-1] if generations else 0
            holder = self._read(top) if generations else None
            if holder is not None and holder.alive():
                raise LeaseHeldError(
                    f"{self.job} is already held by a {holder.describe()}; one process at a time writes a job's "
                    f"checkpoint: stop it first (`lakestream savepoint create {self.job}` stops a stream after its "
                    "batch) or wait for it to end")
            now = int(time.time() * 1000)
            mine = Holder(generation=top + 1, host=socket.gethostname(), pid=os.getpid(), purpose=purpose,
                          since_ms=now, renewed_ms=now, ttl_ms=self.ttl_ms, pid_start=pid_start_of(os.getpid()),
                          query_id=query_id)
            if self.tree.create(f"lease-{mine.generation:012d}.json", json.dumps(asdict(mine)).encode()):
                self.mine = mine
                self._valid_until_ms = now + self.ttl_ms
                self._lost = None
                for old in generations:  # (the dead holders' files, and their stop requests)
                    self.tree.delete(f"lease-{old:012d}.json")
                    self.tree.delete(f"stop-{old:012d}")
                return self
            # another taker created that generation first: look again (it is alive, so that refuses)
        raise LeaseHeldError(f"{self.job}: another process keeps taking the lease; try again")

    def release(self) -> None:
        """Give the lease back (only if still ours: a process that lost it leaves the new holder alone)."""
        self._stopping.set()
        mine, self.mine = self.mine, None
        if mine is None:
            return
        if self._generations()[-1:] == [mine.generation]:
            self.tree.delete(f"stop-{mine.generation:012d}")
            self.tree.delete(f"lease-{mine.generation:012d}.json")

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # -- holding -------------------------------------------------------------------------------
    def renew(self) -> None:
        """Prove the holder alive; raise ``LeaseLostError`` when a newer holder took the lease over."""
        mine = self.mine
        if mine is None:
            raise LeaseLostError(f"{self.job}: this process does not hold the lease")
        generations = self._generations()
        if generations[-1:] != [mine.generation]:
            newer = self._read(generations[-1]) if generations else None
            self._lost = (f"{self.job}: the lease was taken over"
                          + (f" ({newer.describe()})" if newer else "") + "; this runner stops without committing")
            raise LeaseLostError(self._lost)
        now = int(time.time() * 1000)
        renewed = Holder(**{**asdict(mine), "renewed_ms": now})
        self.tree.write(f"lease-{mine.generation:012d}.json", json.dumps(asdict(renewed)).encode())
        self.mine = renewed
        self._valid_until_ms = now + self.ttl_ms

    def keep_alive(self) -> "Lease":
        """Renew in a background thread every ``ttl / 6`` until released."""
        def run() -> None:
            while not self._stopping.wait(self.ttl_ms / 6000):
                try:
                    self.renew()
                except LeaseLostError:
                    return
                except OSError:
                    continue  # (a passing storage error: the lease stays valid until its ttl runs out)

        self._stopping.clear()
        self._renewer = threading.Thread(target=run, name=f"lease-{self.job}", daemon=True)
        self._renewer.start()
        return self

    def check(self) -> None:
        """Before a commit: raise ``LeaseLostError`` unless this process surely still holds the lease (it
        renewed within the last ttl, less a margin, and no newer holder was seen)."""
        if self._lost:
            raise LeaseLostError(self._lost)
        if self.mine is None or time.time() * 1000 > self._valid_until_ms - self.ttl_ms / 6:
            self.renew()  # the renewer is late: renew now, or find out the lease is lost

    # -- requests to the holder ------------------------------------------------------------------
    def request_stop(self, holder: Holder) -> None:
        """Ask ``holder`` to stop after its current batch."""
        self.tree.write(f"stop-{holder.generation:012d}", json.dumps({"requested_ms": int(time.time() * 1000)}).encode())

    def stop_requested(self) -> bool:
        return self.mine is not None and self.tree.exists(f"stop-{self.mine.generation:012d}")

    # -- a restore under way ---------------------------------------------------------------------
    def pending_restore(self) -> str | None:
        """The savepoint of a restore that began and did not finish, if any."""
        try:
            return json.loads(self.tree.read_text("restore.json"))["savepoint"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def begin_restore(self, savepoint_id: str) -> None:
        self.tree.write("restore.json", json.dumps({"savepoint": savepoint_id, "began_ms": int(time.time() * 1000)}).encode())

    def end_restore(self) -> None:
        self.tree.delete("restore.json")


def legacy_marker(tree: Tree) -> dict | None:
    """The ``lakestream/running`` marker an earlier lakestream wrote into a checkpoint, when its process
    still runs on this host (its streams hold no lease)."""
    try:
        info = json.loads(tree.read_text("lakestream/running"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(info, dict) or info.get("host") != socket.gethostname():
        return None
    try:
        return info if process_alive(int(info["pid"]), None) else None
    except (KeyError, TypeError, ValueError):
        return None
