"""Who runs a job's stream, and the requests addressed to it, as files inside its checkpoint
(``lakestream/running``, ``lakestream/stop-request``; see ``layout``)."""

from __future__ import annotations

import json
from typing import Any
import os
import socket
import time

from ..spark.hadoopfs import HadoopFS
from .layout import Layout


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


class StreamControl:
    """Files beside the engine state that let other processes see and stop a running stream.

    ``running`` (pid, host, query id) exists while a process runs the stream; ``stop-request``
    asks it to stop after its current batch (stop-with-savepoint uses both).
    """

    def __init__(self, spark, checkpoint: str):
        self._fs = HadoopFS(spark)
        layout = Layout(checkpoint)
        self.running_path = layout.running
        self.stop_path = layout.stop_request

    def mark_running(self, query_id: str | None) -> None:
        self._fs.delete(self.stop_path)  # a request addressed to an earlier run is void
        info = {"pid": os.getpid(), "host": socket.gethostname(), "query_id": query_id, "started_ms": int(time.time() * 1000)}
        self._fs.write_text(self.running_path, json.dumps(info))

    def running(self) -> dict | None:
        """The running marker, or None. A marker left by a dead process on this host is ignored."""
        try:
            info = json.loads(self._fs.read_text(self.running_path))
        except (ValueError, FileNotFoundError):  # none, or cleared meanwhile: the stream has just stopped
            return None
        return live_marker(info)

    def request_stop(self) -> None:
        self._fs.write_text(self.stop_path, json.dumps({"requested_ms": int(time.time() * 1000)}))

    def stop_requested(self) -> bool:
        return self._fs.exists(self.stop_path)

    def clear(self) -> None:
        self._fs.delete(self.running_path)
        self._fs.delete(self.stop_path)
