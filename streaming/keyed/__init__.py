"""Keyed state for custom logic, in the spirit of Flink's ``KeyedProcessFunction``.

``function`` and ``state`` are the API jobs use; ``runtime`` runs a function per key in plain
Python; ``spark`` binds the runtime to Spark 3.5's keyed state (``applyInPandasWithState`` on
the RocksDB state store). Jobs never import the binding, so Spark 4's
``transformWithStateInPandas`` can replace it without touching them.
"""

from .function import EVENT_TIME, PROCESSING_TIME, Context, KeyedProcessFunction, RuntimeContext, TimerService
from .state import (
    ON_CREATE_AND_WRITE,
    ON_READ_AND_WRITE,
    ListStateDescriptor,
    MapStateDescriptor,
    TtlConfig,
    ValueStateDescriptor,
)

__all__ = [
    "EVENT_TIME",
    "PROCESSING_TIME",
    "ON_CREATE_AND_WRITE",
    "ON_READ_AND_WRITE",
    "Context",
    "KeyedProcessFunction",
    "ListStateDescriptor",
    "MapStateDescriptor",
    "RuntimeContext",
    "TimerService",
    "TtlConfig",
    "ValueStateDescriptor",
]
