"""Window kinds over event time: each kind is plain frozen data that also knows its own logic.

All windows are half-open, ``[start, end)``, in UTC milliseconds since the epoch.

* ``Tumbling(size)``: fixed, non-overlapping windows ``[k*size, (k+1)*size)``.
* ``Sliding(size, every)``: windows of length ``size`` starting every ``every``
  (``[k*every, k*every + size)``); an event belongs to every window that contains it, so to
  ``ceil(size / every)`` windows at most.
* ``Session(gap)``: per key, events closer than ``gap`` form one session. Each event opens the
  window ``[t, t + gap)``; windows of one key that overlap *or touch* merge (Flink's rule: two
  events exactly ``gap`` apart stay in one session, 1 ms more starts a new one). A session is
  ``[first event, last event + gap)``.

The engine (``streaming.windowed``), the backfill and the reconciliation ask a window the questions of
:class:`~streaming.windows.base.Window` and never which kind it is: a new kind is one module here that
subclasses it (see docs/extending.md).
"""

from .base import WE, WS, Fired, Firing, Window
from .session import Session
from .sliding import Sliding
from .tumbling import Tumbling

__all__ = ["WE", "WS", "Fired", "Firing", "Session", "Sliding", "Tumbling", "Window"]
