"""A checkpoint and landing zone copied to fsspec's memory:// file system, as a cluster job would have
written them to s3a:// or abfss:// (no object store is reachable here)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import fsspec

from streaming.checkpoint.tree import landing_files


def upload(settings, job: str, sources=("payments",)) -> tuple[str, str]:
    """Copy ``job``'s checkpoint and the sources' landing folders to a fresh memory:// bucket; the
    source log is rewritten to name the files where they now are, with the modification times the copies
    have there (as Spark, reading them there, would have recorded). Returns (checkpoints root, landing root)."""
    fs = fsspec.filesystem("memory")
    bucket = f"/bucket-{os.getpid()}-{len(fs.store)}"
    for source in sources:
        landing = Path(settings.landing_dir(source)).resolve()
        for path in landing.iterdir():
            fs.pipe(f"{bucket}/landing/{source}/{path.name}", path.read_bytes())
    copies = {}
    for source in sources:
        copies.update(landing_files(f"memory://{bucket}/landing/{source}"))
    checkpoint = Path(settings.checkpoint_dir(job))
    for path in (p for p in checkpoint.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.parent.parent.name == "sources" and not path.name.startswith("."):  # the source log names the files where Spark read them
            for source in sources:
                local = Path(settings.landing_dir(source)).resolve()
                data = data.replace(f"file://{local}".encode(), f"memory://{bucket}/landing/{source}".encode())
            data = _with_mtimes(data.decode(), copies).encode()
        fs.pipe(f"{bucket}/checkpoints/{job}/{path.relative_to(checkpoint)}", data)
    return f"memory://{bucket}/checkpoints", f"memory://{bucket}/landing"


def _with_mtimes(log: str, copies: dict) -> str:
    lines = log.split("\n")
    for i, line in enumerate(lines[1:], start=1):
        if line.strip():
            entry = json.loads(line)
            key = next((k for k in copies if entry["path"].endswith(k.lstrip("/"))), None)
            if key is not None:
                entry["timestamp"] = copies[key][1]
            lines[i] = json.dumps(entry, separators=(",", ":"))
    return "\n".join(lines)


def remove(root: str) -> None:
    fs = fsspec.filesystem("memory")
    fs.rm("/" + root.split("://", 1)[1].strip("/").split("/", 1)[0], recursive=True)
