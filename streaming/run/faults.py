"""Named points inside a micro-batch where a test can stop the world (bytewax's ``ABORT()`` markers).

A windowed batch passes ``batch-start`` before it reads its input; a batch passes
``committed:<table>`` after each table commit, ``before-state`` before its engine
record is written and ``after-state`` once everything is written (Spark then records the batch
as committed). In-process tests pass a function that raises at a point. A crash test that kills a
child process sets ``LAKESTREAM_PAUSE_AT=<point>[,<point>...]``: at the first matching point the
child writes ``<LAKESTREAM_PAUSE_DIR>/<point>@<batch>`` and sleeps, so the parent can SIGKILL
it exactly there.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Mapping

FaultFn = Callable[[str, int], None]


def pause_from_environment(environ: Mapping[str, str] | None = None) -> FaultFn | None:
    env = os.environ if environ is None else environ
    points = [p for p in env.get("LAKESTREAM_PAUSE_AT", "").split(",") if p]
    if not points:
        return None
    folder = Path(env.get("LAKESTREAM_PAUSE_DIR", "."))
    seconds = float(env.get("LAKESTREAM_PAUSE_SECONDS", "30"))
    fired: set[str] = set()

    def pause(point: str, batch_id: int) -> None:
        if point in points and point not in fired:
            fired.add(point)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{point}@{batch_id}").write_text(str(os.getpid()))
            time.sleep(seconds)

    return pause
