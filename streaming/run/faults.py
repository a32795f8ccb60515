"""Named points inside a micro-batch where a test can stop the world (bytewax's ``ABORT()`` markers).

A windowed batch passes ``batch-start`` before it reads its input; a batch passes
``committed:<table>`` after each table commit, ``before-state`` before its engine
record is written and ``after-state`` once everything is written (Spark then records the batch
as committed). In-process tests pass a function that raises at a point. A crash test that kills a
child process sets ``LAKESTREAM_PAUSE_AT=<point>[,<point>...]`` (read into ``Settings.pause_at``): at the
first matching point the child writes ``<pause_dir>/<point>@<batch>`` and sleeps, so the parent can
SIGKILL it exactly there.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

FaultFn = Callable[[str, int], None]


def pauses(settings) -> FaultFn | None:
    """The pause function of ``settings.pause_at`` (None: no fault point is set)."""
    points = list(settings.pause_at)
    if not points:
        return None
    folder = Path(settings.pause_dir)
    seconds = settings.pause_seconds
    fired: set[str] = set()

    def pause(point: str, batch_id: int) -> None:
        if point in points and point not in fired:
            fired.add(point)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{point}@{batch_id}").write_text(str(os.getpid()))
            time.sleep(seconds)

    return pause
