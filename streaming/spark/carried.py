"""An event's landing file and original fields, carried through a job's transform.

A late row names the file its event came from and keeps the event as it arrived, whatever columns the job's
transform keeps. The transform receives a frame whose projections keep one more struct column, :data:`FILE`:
a ``select`` that would drop it gets it appended (a projection that cannot take it, an aggregate say, stays
as written). Frames made another way (SQL over a view) do not carry it: the caller sees :data:`FILE` missing
from the transform's output and finds the originals another way.
"""

from __future__ import annotations

from typing import Callable

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

FILE = "_lakestream_file"


class Carrying(DataFrame):
    """A frame every frame made from which keeps :data:`FILE` (see the module)."""

    _KEEPING = frozenset({"select", "selectExpr"})

    def __getattribute__(self, name):
        attr = super().__getattribute__(name)
        if name.startswith("_") or not callable(attr):
            return attr

        def carried(*args, **kwargs):
            out = attr(*args, **kwargs)
            if not isinstance(out, DataFrame):
                return out
            if name in Carrying._KEEPING and FILE not in out.columns:
                try:
                    out = attr(*args, FILE if name == "selectExpr" else F.col(FILE), **kwargs)
                except Exception:  # (not a row-for-row projection: nothing to carry the file through)
                    return out
            if FILE in out.columns:
                out.__class__ = Carrying
            return out

        return carried


def transformed_carrying(frame: DataFrame, original: Column, transform: Callable[[DataFrame], DataFrame]) -> DataFrame:
    """``transform(frame)``, with ``original`` (a struct of what a late row needs of the event as it arrived) as
    :data:`FILE` wherever the transform keeps rows as they are. The result is a plain frame. A transform that
    refuses the extra column (one that renames every column by position, say) gets ``frame`` as it is, and its
    output carries nothing."""
    carrying = frame.withColumn(FILE, original)
    carrying.__class__ = Carrying
    try:
        out = transform(carrying)
    except Exception:  # noqa: BLE001 - the transform's own error, if any, comes again from the plain frame
        return transform(frame)
    if isinstance(out, Carrying):
        out.__class__ = DataFrame
    return out
