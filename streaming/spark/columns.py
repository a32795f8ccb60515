"""Column expressions a stream builds the same way every micro-batch, built once per JVM instead.

Each ``F.col``, ``cast`` or ``alias`` is a py4j round trip to the driver's JVM, and each Python proxy
it leaves behind costs another one (a release) when it is collected. A small micro-batch made ~1,600
of them; with both cores busy running the batch's jobs each took milliseconds. Expressions that
depend on the batch (its watermark, its buckets) are still built per batch.
"""

from __future__ import annotations

import threading
from typing import Callable, Hashable, TypeVar

V = TypeVar("V")

_BUILT: dict[tuple, tuple[object, object]] = {}
_LOCK = threading.Lock()


def once(key: Hashable, build: Callable[[], V], owner: object = None) -> V:
    """``build()``'s result, cached per ``key`` and JVM. ``owner`` (e.g. a job): also per that object
    (by identity, for objects that are not hashable), and kept alive while the entry is."""
    from pyspark import SparkContext

    jvm = id(SparkContext._active_spark_context)  # noqa: SLF001 - a new JVM needs new expressions
    full = (key, id(owner), jvm)
    got = _BUILT.get(full)
    if got is not None and got[0] is owner:
        return got[1]  # type: ignore[return-value]
    value = build()
    with _LOCK:
        for stale in [k for k in _BUILT if k[2] != jvm]:
            del _BUILT[stale]
        _BUILT[full] = (owner, value)
    return value


def _seq(columns: list, skip: int = 0):
    """The Java sequence of ``columns[skip:]`` (a list built by :func:`once`), built once too: py4j
    fills a Java list one round trip per element."""
    from pyspark import SparkContext

    def build():
        sc = SparkContext._active_spark_context  # noqa: SLF001
        return sc._jvm.PythonUtils.toSeq([c._jc for c in columns[skip:]])  # noqa: SLF001

    return once(("java seq", skip), build, columns)


def select(frame, columns: list):
    """``frame.select(*columns)`` for a list of columns built by :func:`once`."""
    from pyspark.sql import DataFrame

    return DataFrame(frame._jdf.select(_seq(columns)), frame.sparkSession)  # noqa: SLF001


def group(frame, keys: list, aggregates: list):
    """``frame.groupBy(*keys).agg(*aggregates)`` for lists of columns built by :func:`once`."""
    from pyspark.sql import DataFrame

    grouped = frame._jdf.groupBy(_seq(keys))  # noqa: SLF001
    return DataFrame(grouped.agg(aggregates[0]._jc, _seq(aggregates, 1)), frame.sparkSession)  # noqa: SLF001


# -- constants that change every batch --------------------------------------------------------------
# Spark writes a long or timestamp literal into the Java it compiles for a stage, so a plan whose
# constant changes every batch (a watermark, a range of window starts) compiles its stages again
# every batch, and their first rows run in the JVM's interpreter: a 1M-event stream of 50k-event
# batches spent ~25% of its time so. A decimal literal reaches the compiled code as a reference
# instead: batches that differ only in such a value reuse one class.
_PARAM_TYPE = "decimal(18,0)"
_PARAM_LIMIT = 10**17  # beyond any timestamp's unix_millis (year 294247 is ~9.2e15)


def param(value: int):
    """A whole number (e.g. milliseconds) as a batch parameter: compare it with :func:`as_param`."""
    from decimal import Decimal

    from pyspark.sql import functions as F

    return F.lit(Decimal(max(-_PARAM_LIMIT, min(_PARAM_LIMIT, int(value))))).cast(_PARAM_TYPE)


def as_param(column):
    """A long column in the type of :func:`param` (for comparisons with it)."""
    return column.cast(_PARAM_TYPE)


def one_of(column, values):
    """``column`` in ``values``, as an array literal (a reference too, where ``isin`` inlines each value)."""
    from pyspark.sql import functions as F

    return F.array_contains(F.array(*[F.lit(v) for v in values]), column)


def in_set(name: str, values: list[int]):
    """Whether the long column ``name`` is one of ``values``: a hash set the compiled code references
    (Spark writes an ``IN`` of up to 10 values into the code, so a short list is padded with negative
    numbers: its class is reused batch after batch)."""
    from pyspark.sql import functions as F

    padded = [*dict.fromkeys(int(v) for v in values)]
    padded += [p for p in range(-1, -12, -1) if p not in padded][:max(0, 11 - len(padded))]
    return F.expr(f"`{name}` IN ({', '.join(f'{v}L' for v in padded)})")


# -- joins on keys that may be NULL --------------------------------------------------------------------------
def same_keys(keys, prefix: str):
    """``left.k <=> right.<prefix>k`` for every key: keys that may be NULL join like any value (a NULL key is
    a group of its own, as in GROUP BY)."""
    from functools import reduce

    from pyspark.sql import functions as F

    return reduce(lambda a, b: a & b, [F.col(k).eqNullSafe(F.col(f"{prefix}{k}")) for k in keys])


def join_keys(left, right, keys, how: str = "inner"):
    """``left.join(right, keys, how)`` with NULL-safe equality on ``keys`` (Spark's join on names drops rows
    whose key is NULL). The result has each key once, as the join on names has (coalesced for outer joins)."""
    from pyspark.sql import functions as F

    keys = list(keys)
    renamed = right.select(*[F.col(k).alias(f"_jk_{k}") for k in keys], *[c for c in right.columns if c not in keys])
    joined = left.join(renamed, same_keys(keys, "_jk_"), how)
    if how in ("left_semi", "semi", "leftsemi", "left_anti", "anti", "leftanti"):
        return joined
    if how in ("full_outer", "full", "outer", "fullouter", "right", "right_outer"):
        rest = [c for c in joined.columns if c not in keys and not c.startswith("_jk_")]
        return joined.select(*[F.coalesce(F.col(k), F.col(f"_jk_{k}")).alias(k) for k in keys], *rest)
    return joined.drop(*[f"_jk_{k}" for k in keys])
