"""What every source kind does. Every kind hands the parser the same frame, streaming or bounded:
``value`` (one record's text: a JSON object, or a CSV record), ``source_file`` (where it came from),
``_source`` (the source's name), ``_problem`` (a reason found before parsing, else NULL) and
``_arrival`` (the record's place in the order of arrival, see :func:`arrival`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (for annotations only: streaming.declaration imports this package)
    from pyspark.sql import DataFrame

    from ...declaration import Source
    from ...settings import Settings

SOURCE = "_source"  # the raw frame's column naming the source of a record (jobs with several sources)


_EPOCH_MS = 1_577_836_800_000  # 2020-01-01: arrival keys count milliseconds from here (41 bits: until 2089)


def arrival(modified, path, block_start):
    """A record's arrival key, one long: its file's modification time (ms), then the file (a 10-bit hash
    of its path: files modified in the same millisecond), then the part of the file (128 MiB pieces: a
    large file is read in splits); records of one part keep their order as read. Of two deliveries of
    one id, the one with the smaller key arrived first (a stream lists files in modification order)."""
    from pyspark.sql import functions as F

    t = F.greatest(F.unix_millis(modified) - F.lit(_EPOCH_MS), F.lit(0)).cast("long")
    file = F.xxhash64(path).bitwiseAND(F.lit(0x3FF))
    part = F.least(F.shiftright(block_start, 27), F.lit(0xFFF)).cast("long")
    return F.shiftleft(t, 22).bitwiseOR(F.shiftleft(file, 12)).bitwiseOR(part)


NO_ARRIVAL = 0  # (sources whose records carry no arrival order: tables)


def union(frames: list) -> DataFrame:
    raw = frames[0]
    for frame in frames[1:]:
        raw = raw.unionByName(frame)
    return raw


class SourceKind(ABC):
    """How lakestream reads one kind of source (see the package)."""

    name: str

    # -- the declaration ------------------------------------------------------------------------
    def check(self, source: Source) -> None:
        """Refuse (``DeclarationError``) what this kind cannot read, when the ``Source`` is declared."""

    # -- where ----------------------------------------------------------------------------------
    @abstractmethod
    def location(self, settings: Settings, source: Source) -> str:
        """Where the records come from, for people (a folder, a table)."""

    lands_in_folder = False  # records arrive as files in a landing folder (see landing_folder)

    def landing_folder(self, settings: Settings, source: Source) -> str | None:
        """The folder of files this source's stream lists, if any: checkpoint inspection counts what waits
        there, and Dagster observes it as a landing asset."""
        return None

    def upstream_table(self, source: Source) -> str | None:
        """The lake table this source reads, if any (Dagster draws lineage from it)."""
        return None

    # -- reading --------------------------------------------------------------------------------
    @abstractmethod
    def stream(self, spark, settings: Settings, source: Source, *, max_files_per_trigger: int | None) -> DataFrame:
        """The source's records as a stream (exactly-once through the checkpoint's offsets)."""

    @abstractmethod
    def read(self, spark, settings: Settings, source: Source, *, position: int | None = None,
             files: list[str] | None = None) -> DataFrame:
        """The source's records as a batch: everything, up to ``position`` (see :meth:`position`), or only
        ``files`` (kinds that read files)."""

    def paced_under_available_now(self, max_files_per_trigger: int | None) -> bool:
        """Whether an available-now run with this read limit needs a processing-time trigger to keep the limit
        (Spark's availableNow trigger reads everything at once for such a source)."""
        return False

    # -- position -------------------------------------------------------------------------------
    def position(self, offset: Any) -> int | None:
        """Where a stream stands in this source, from its Spark offset (e.g. a table's snapshot id), when the
        source can be read as of it; None otherwise (files: the stream's file log says what it has read)."""
        return None

    def describe_position(self, position: int) -> str:
        return str(position)

    # -- tests ----------------------------------------------------------------------------------
    one_delivery_per_trigger = False  # with max_files_per_trigger=1, each delivery (see land) is one batch

    @abstractmethod
    def land(self, spark, settings: Settings, source: Source, records: Any, name: str, *, empty: bool = False,
             mtime: float | None = None) -> list[Path]:
        """Deliver ``records`` where the stream finds them, as one delivery named ``name`` (a test harness's
        micro-batch); returns the files written, if any. ``empty``: deliver even no records (a file kind
        writes an empty file); ``mtime``: the delivery's modification time."""

    def reset(self, spark, source: Source) -> None:
        """Start a test harness's input over (e.g. drop an upstream table it created)."""
