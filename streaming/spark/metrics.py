"""Counts taken while a query runs (Spark's observed metrics), so a batch learns its row counts from the
pass that writes its rows instead of from a job of its own."""

from __future__ import annotations

from pyspark.sql import DataFrame, Observation
from pyspark.sql import functions as F

from .jvm import observation_name, observation_value

_METRICS = "m"


def observe(frame: DataFrame, observation: Observation, metrics: list[F.Column] | F.Column) -> DataFrame:
    """``frame`` observed by ``observation``: the named aggregates ``metrics`` (or their :func:`packed`
    column), read with :func:`observed`. They travel as one JSON text (reading a metrics map entry by
    entry costs py4j calls each)."""
    return frame.observe(observation, metrics if isinstance(metrics, F.Column) else packed(metrics))


def packed(metrics: list[F.Column]) -> F.Column:
    return F.to_json(F.struct(*metrics)).alias(_METRICS)


def observed(observation: Observation, timeout_s: float = 300.0) -> dict:
    """The metrics an action observed (see :func:`observe`; a metric that is NULL is None).
    ``Observation.get`` waits for ever when the metrics node was optimised away; fail with a clear
    error instead (the stream restarts and replays the batch)."""
    import json
    import threading
    from collections import defaultdict

    from ..errors import EngineError

    box: list = []
    waiter = threading.Thread(target=lambda: box.append(observation_value(observation, _METRICS)), daemon=True)
    waiter.start()
    waiter.join(timeout_s)
    if not box:
        raise EngineError(f"Spark reported no metrics for {observation_name(observation)} within {timeout_s:.0f}s")
    return defaultdict(lambda: None, json.loads(box[0]))


def observed_if_any(observation: Observation, timeout_s: float = 5.0) -> dict | None:
    """The metrics of an action that may not have run (a write skipped because its commit was found): None
    when none arrive within ``timeout_s``."""
    from ..errors import EngineError

    try:
        return observed(observation, timeout_s)
    except EngineError:
        return None
