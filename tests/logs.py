"""A failing test's view of a process's log: the first error it records, whole, then its end.

The end alone is not enough: once one query of an application fails, the others are stopped and log on, and the
first failure's message (a Python traceback inside a Java one) is pushed out of any fixed tail."""

from __future__ import annotations

from pathlib import Path

# Where a log says what went wrong first: Spark's record of a failed query, a Python traceback, our one-line error
_MARKERS = ("terminated with error", "Traceback (most recent call last)", "lakestream: error:")


def excerpt(path: Path, tail: int = 3000, first: int = 8000) -> str:
    """The first error recorded in ``path`` (up to ``first`` characters from its marker) and the log's last ``tail``."""
    if not path.exists():
        return f"({path} was not written)"
    text = path.read_text(errors="replace")
    found = [i for i in (text.find(m) for m in _MARKERS) if i >= 0]
    if not found or min(found) >= len(text) - tail:
        return text[-tail:]
    at = min(found)
    start = text.rfind("\n", 0, at) + 1
    return f"{text[start:start + first]}\n[...]\n{text[-tail:]}"
