"""Source kinds: how each kind of source is streamed, read bounded, positioned, watched and fed in tests.

A ``Source`` declaration says its ``format``; the kind behind that format (a :class:`SourceKind`) does
everything format-specific, and nothing outside this package asks which kind a source is:

* ``files`` (``json``, ``csv``, ``parquet``): a landing folder of files, read in arrival order;
* ``table`` (``table``): another job's append-only Iceberg table, followed snapshot by snapshot.

A new kind (Kafka, say) is one module here defining a ``SourceKind`` and one entry in ``KINDS``
(see docs/extending.md). Nothing here imports Spark until a kind is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (for annotations only: streaming.declaration imports this package)
    from ...declaration import Job, Source
    from .base import SourceKind

# format -> the module (in this package) whose KIND reads it
KINDS = {"json": "files", "csv": "files", "parquet": "files", "table": "table"}
FORMATS = tuple(KINDS)

_LOADED: dict[str, SourceKind] = {}


def kind_of(source: Source | str) -> SourceKind:
    """The kind that reads ``source`` (a declaration, or a format name)."""
    fmt = source if isinstance(source, str) else source.format
    module = KINDS[fmt]
    if module not in _LOADED:
        _LOADED[module] = importlib.import_module(f"{__name__}.{module}").KIND
    return _LOADED[module]


def stream_all(spark, settings, job: Job):
    """The records of every source of ``job`` as one stream (``value``, ``source_file``, ``_source``,
    ``_problem``; see ``base``)."""
    from .base import union

    limit = settings.job(job.name).max_files_per_trigger
    return union([kind_of(s).stream(spark, settings, s, max_files_per_trigger=limit) for s in job.sources])


def read_all(spark, settings, job: Job, positions: dict[str, int] | None = None):
    """The records of every source of ``job`` as one batch; a source with a position in ``positions`` (by
    source name, see :meth:`SourceKind.position`) is read up to it."""
    from .base import union

    return union([kind_of(s).read(spark, settings, s, position=(positions or {}).get(s.name)) for s in job.sources])


def positions(job: Job, offsets: list | None) -> dict[str, int]:
    """Where the stream's last committed batch left each source that has a position, by source name, from
    Spark's per-source offsets (one per source, in the job's order)."""
    found = {}
    for source, offset in zip(job.sources, offsets or []):
        position = kind_of(source).position(offset)
        if position is not None:
            found[source.name] = position
    return found


__all__ = ["FORMATS", "KINDS", "kind_of", "positions", "read_all", "stream_all"]
