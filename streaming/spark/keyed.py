"""Spark 3.5 binding of the keyed runtime: ``applyInPandasWithState`` (stream) and
``applyInPandas`` (bounded), on the RocksDB state store.

One streaming query per job. Valid events are transformed, keyed and handed to the runtime;
invalid lines travel in the same query under a NULL key (the runtime passes them through as
quarantine rows), so one checkpoint and one ``foreachBatch`` cover every output. Keys are grouped
in buckets; each key's state (the runtime's pickled state) is a row of the bucket's key files
(``keyed.files``), and Spark's group state of a bucket is small: the names of those files and the
bucket's earliest wake-up. A batch reads and writes only the keys it runs, so its cost does not
grow with the keys the stream remembers. Event-time wake-ups use Spark's
``EventTimeTimeout`` (a key times out once the watermark passes ``wake-up - 1``); jobs with
processing-time timers use ``ProcessingTimeTimeout`` and poll for event time at each batch.

Spark drops rows behind the watermark before an ``EventTimeTimeout`` state function sees them, by
the input column that carries the watermark. The input therefore carries the watermark on a
constant far-future column (``_never_late``): the query keeps its watermark and its timeouts,
and a late event reaches the runtime, which sends it to the late side output instead of
dropping it silently.
"""

from __future__ import annotations

import functools
import gc
import json
import pickle
import time
import warnings
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Iterator

import numpy as np
import pandas as pd
import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.streaming.state import GroupStateTimeout

from ..keyed import files as keys
from ..declaration import KeyedJob
from ..errors import DeclarationError
from . import pyworkers
from .carried import FILE, transformed_carrying
from .jvm import parse_ddl
from ..keyed.function import PROCESSING_TIME
from ..keyed.runtime import KeyedRuntime

_NEVER_LATE = "_never_late"
_NEVER_LATE_VALUE = 2**62  # microseconds: year ~146,000
_STATE_SCHEMA = "blob binary"
PAYLOAD, OUT, KEY = "_p_", "_o_", "_k_"
BUCKET = "_bucket"
# Keys are handled in buckets: one Python call per bucket and batch, not per key. The count is part of a
# stream's state layout: each checkpoint records it (``BatchRecord.key_buckets``) and keeps it for life.
LEGACY_KEY_BUCKETS = 64  # checkpoints written before the count was recorded
BUCKETS_PER_PARTITION = 4
BOUNDED_KEY_BUCKETS = 64  # the bounded twin: no state to keep, many groups to spread a large input
# A stream's call keeps the states of the keys it ran as objects for their next call (``keyed.runtime.Live``) when it
# ran at most this many: a busy key is run again in the next batch, but a call over thousands of keys (a backlog, a
# burst of new keys) left objects that PySpark's collection after every task walked until the bucket's next call.
LIVE_KEYS_MAX = 1_000


def _spark_int_hash(value: int, seed: int = 42) -> int:
    """Spark's ``hash`` of an int column (Murmur3 x86 32-bit of the 4-byte value, seed 42), which its hash
    partitioning uses: a group goes to shuffle partition ``pmod(hash(value), partitions)``."""
    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF

    k1 = rotl(((value & 0xFFFFFFFF) * 0xCC9E2D51) & 0xFFFFFFFF, 15) * 0x1B873593 & 0xFFFFFFFF
    h1 = (rotl(seed ^ k1, 13) * 5 + 0xE6546B64) & 0xFFFFFFFF
    h1 ^= 4
    h1 = ((h1 ^ (h1 >> 16)) * 0x85EBCA6B) & 0xFFFFFFFF
    h1 = ((h1 ^ (h1 >> 13)) * 0xC2B2AE35) & 0xFFFFFFFF
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 & 0x80000000 else h1


def spread_labels(buckets: int, shuffle_partitions: int) -> tuple[int, ...] | None:
    """A grouping value for each bucket such that Spark's hash partitioning sends bucket ``i`` to partition
    ``i % shuffle_partitions``: every task gets the same number of buckets (None: no such values among the
    first ``64 * buckets`` ints, not expected)."""
    free: dict[int, list[int]] = {}
    for v in range(64 * buckets):
        free.setdefault(_spark_int_hash(v) % shuffle_partitions, []).append(v)
    try:
        return tuple(free[i % shuffle_partitions][i // shuffle_partitions] for i in range(buckets))
    except (KeyError, IndexError):
        return None


def bucket_labels(record, buckets: int, shuffle_partitions: int) -> tuple[int, ...] | None:
    """The grouping value of each bucket, fixed per checkpoint like the count (None: the bucket's number,
    as checkpoints written before labels were recorded have it).

    Spark sends a group to shuffle partition ``pmod(hash(value), partitions)``. Bucket numbers 0..15 land
    3, 3, 4 and 6 to a partition of 4, and the fullest partition's task set the pace of every batch (on
    2 cores: 9 buckets' time instead of 8, with the last task alone). A new stream gives bucket ``i`` a
    value that Spark sends to partition ``i % partitions`` (:func:`spread_labels`): every task gets the
    same number of buckets."""
    if record is not None:
        return record.bucket_labels
    return spread_labels(buckets, shuffle_partitions)


def key_buckets(record_buckets: int | None, has_record: bool, shuffle_partitions: int) -> int:
    """The bucket count of a keyed stream: its checkpoint's, else a few per shuffle partition (each call
    costs a fixed ~8 ms of pandas and Arrow conversions, so a 14k-event batch spent 0.4 s more in 64
    calls than in 16; fewer buckets than partitions would leave partitions idle)."""
    if record_buckets:
        return record_buckets
    if has_record:
        return LEGACY_KEY_BUCKETS
    return BUCKETS_PER_PARTITION * max(1, shuffle_partitions)


def transformed_events(job: KeyedJob, parsed: DataFrame, *, watermark: bool = False,
                       carry_file: bool = False) -> DataFrame:
    """The job's transform over the valid events of ``parsed``; ``carry_file``: with :data:`FILE` (the event's
    landing file, and every field its source declares as JSON, as a windowed job's late row has them)
    wherever the transform keeps rows as they are."""
    valid = parsed.where(F.col("_reason").isNull()).drop("_raw", "_reason", "_arrival")  # (io.parse.LINE_COLUMNS)
    if watermark:
        valid = valid.withWatermark(job.source.event_time, f"{job.watermark.out_of_orderness_ms} milliseconds")
    if carry_file and "source_file" in valid.columns:
        fields = [n for n in dict.fromkeys(n for s in job.sources for n in s.field_names) if n in valid.columns]
        out = transformed_carrying(valid, F.struct(F.col("source_file").alias("f"),
                                                   F.to_json(F.struct(*[F.col(n) for n in fields])).alias("e")),
                                   job.transform)
    else:
        out = job.transform(valid)
    missing = [c for c in (*job.keys, job.source.event_time, job.source.dedup_key) if c not in out.columns]
    if missing:
        raise DeclarationError(
            f"job {job.name}: transform output lacks column(s) {missing}; it must keep the keys, the event-time "
            "column and the dedup key"
        )
    return out


def main_schema(job: KeyedJob) -> T.StructType:
    """The main table's schema: the job's declared ``output``."""
    return parse_ddl(job.output)


def _bucket(job: KeyedJob, buckets: int, labels: tuple[int, ...] | None = None) -> F.Column:
    number = F.pmod(F.xxhash64(*[F.col(k) for k in job.keys]), F.lit(buckets)).cast("int")
    if labels is None:
        return number
    return F.element_at(F.array(*[F.lit(v) for v in labels]), number + 1)


# The runtime's side outputs (late elements, quarantined lines, statistics) cross from Python to the JVM
# packed as one JSON text column: a Python call returns one frame per bucket of keys, and each column
# of a frame costs its own pandas and Arrow conversion whether or not it holds a value.
_SIDE = (
    ("_l_t", T.LongType()), ("_l_id", T.StringType()), ("_l_event", T.StringType()), ("_l_file", T.StringType()),
    ("_l_src", T.StringType()),
    ("_q_src", T.StringType()), ("_q_file", T.StringType()), ("_q_raw", T.StringType()), ("_q_reason", T.StringType()),
    ("_q_n", T.LongType()),
    ("_s_in", T.LongType()), ("_s_dup", T.LongType()), ("_s_max_t", T.LongType()), ("_s_wm", T.LongType()),
    ("_s_rm", T.StringType()),
)
SIDE = "_x"


def _output_schema(job: KeyedJob, main: T.StructType, payload: T.StructType) -> T.StructType:
    """What the Python function returns: the kind, the key, the main row typed, the side row as JSON."""
    fields = [T.StructField("_kind", T.StringType())]
    fields += [T.StructField(KEY + k, payload[k].dataType) for k in job.keys]
    fields += [T.StructField(OUT + f.name, f.dataType) for f in main.fields]
    return T.StructType([*fields, T.StructField(SIDE, T.StringType())])


def _unpacked(frame: DataFrame) -> DataFrame:
    """The function's output with the side row's fields as columns of their own."""
    side = F.from_json(F.col(SIDE), T.StructType([T.StructField(n, t) for n, t in _SIDE]))
    return frame.select(*[c for c in frame.columns if c != SIDE], *[side[n].alias(n) for n, _ in _SIDE])


def _valid_utf8(text: F.Column) -> F.Column:
    return F.decode(F.encode(text, "UTF-8"), "UTF-8")


LATE_FILE, LATE_EVENT = "_f", "_e"  # an element's landing file and original event (a stream's input)
BAD = "_bad"  # an invalid line, as JSON of its source, file, text and reason (NULL on events)


class _Wire:
    """Which input columns carry what to Python. Each column costs its own Arrow and pandas conversion in
    every call, so nothing crosses twice: the keys are read from the payload, the event time (ms) from
    the payload's microseconds and the dedup key from the payload when it is text; an invalid line is one
    JSON text; the far-future watermark column is a number."""

    def __init__(self, job: KeyedJob, payload: T.StructType):
        kinds = {f.name: _payload_kind(f.dataType) for f in payload.fields}
        self.time_from_payload = kinds[job.source.event_time] == "micros"
        self.id_from_payload = isinstance(payload[job.source.dedup_key].dataType, T.StringType)
        self.time = PAYLOAD + job.source.event_time if self.time_from_payload else "_t"
        self.id = PAYLOAD + job.source.dedup_key if self.id_from_payload else "_id"
        self.keys = [PAYLOAD + k for k in job.keys]
        self.key_kinds = [kinds[k] for k in job.keys]


def _inputs(job: KeyedJob, parsed: DataFrame, *, stream: bool, buckets: int,
            labels: tuple[int, ...] | None = None) -> tuple[DataFrame, T.StructType]:
    """Valid transformed events and invalid lines as one frame keyed by ``job.keys``."""
    events = transformed_events(job, parsed, watermark=stream, carry_file=stream)
    payload = T.StructType([f for f in events.schema.fields if f.name != FILE])
    wire = _Wire(job, payload)
    extra, extra_types = [], []
    if stream:  # (a late element names its file and keeps its event: only a stream has late elements)
        carried = FILE in events.columns
        for name, part in ((LATE_FILE, "f"), (LATE_EVENT, "e")):
            extra.append((F.col(FILE)[part] if carried else F.lit(None).cast("string")).alias(name))
            extra_types.append((name, "string"))
    if not wire.time_from_payload:
        extra.append(F.unix_millis(F.col(job.source.event_time)).alias("_t"))
        extra_types.append(("_t", "long"))
    if not wire.id_from_payload:
        extra.append(F.col(job.source.dedup_key).cast("string").alias("_id"))
        extra_types.append(("_id", "string"))
    cols = [
        _bucket(job, buckets, labels).alias(BUCKET),
        *extra,
        # Explicit metadata replaces the watermark marker the event-time column carries.
        *[_encoded(F.col(c), payload[c].dataType).alias(PAYLOAD + c, metadata={"lakestream": "payload"})
          for c in payload.names],
        F.lit(None).cast("string").alias(BAD),
    ]
    bad = parsed.where(F.col("_reason").isNotNull()).select(
        F.lit(None).cast("int").alias(BUCKET),
        *[F.lit(None).cast(dtype).alias(name) for name, dtype in extra_types],
        *[F.lit(None).cast(_wire_type(f.dataType)).alias(PAYLOAD + f.name) for f in payload.fields],
        # A line's bytes need not be UTF-8; Arrow refuses such text on its way to Python. Re-encoding turns
        # every undecodable byte into U+FFFD (the quarantine keeps the line, readably).
        F.to_json(F.struct(F.col("source").alias("s"), F.col("source_file").alias("f"),
                           _valid_utf8(F.col("_raw")).alias("r"), _valid_utf8(F.col("_reason")).alias("why"))).alias(BAD),
    )
    if stream:
        # Spark's check that an event-time timeout has a watermark only looks for the marker; rows are
        # compared with it as microseconds, which this number never reaches.
        never = F.lit(_NEVER_LATE_VALUE).alias(
            _NEVER_LATE, metadata={"spark.watermarkDelayMs": job.watermark.out_of_orderness_ms}
        )
        return events.select(never, *cols).unionByName(bad.select(never, *bad.columns)), payload
    return events.select(*cols).unionByName(bad), payload


# Payload columns cross to Python in a compact form that pickles fast while an element waits in a key's
# state for the watermark (a timestamp as microseconds, a decimal as its text); the runtime decodes each
# element once, when it is delivered to the function.
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _wire_type(dtype: T.DataType) -> T.DataType:
    if isinstance(dtype, T.TimestampType):
        return T.LongType()
    if isinstance(dtype, T.DecimalType):
        return T.StringType()
    return dtype


def _encoded(column: F.Column, dtype: T.DataType) -> F.Column:
    if isinstance(dtype, T.TimestampType):
        return F.unix_micros(column)
    if isinstance(dtype, T.DecimalType):
        return column.cast("string")
    return column


def _payload_kind(dtype: T.DataType) -> str:
    if isinstance(dtype, T.TimestampType):
        return "micros"
    if isinstance(dtype, T.DecimalType):
        return "decimal"
    return _kind_of(dtype)


def _from_micros(value):
    return value if isinstance(value, datetime) else _EPOCH + timedelta(microseconds=value)


_DECODERS = {"micros": _from_micros, "decimal": Decimal}


def _decoded(values: list, kind: str) -> list:
    """A payload column's compact values as :data:`_DECODERS` turns each one, a column at a time."""
    if kind == "micros":
        epoch, step = _EPOCH, timedelta(microseconds=1)
        return [v if v is None or isinstance(v, datetime) else epoch + v * step for v in values]
    convert = _DECODERS[kind]
    return [None if v is None else convert(v) for v in values]


def _decoder(kinds: list[str]):
    """A payload row's compact values back to what the function sees (None: nothing to decode). Rows
    buffered by an older lakestream hold decoded values already, and pass through unchanged."""
    convert = [(i, _DECODERS[k]) for i, k in enumerate(kinds) if k in _DECODERS]
    if not convert:
        return None

    def decode(row: tuple) -> list:
        values = list(row)
        for i, to_value in convert:
            if values[i] is not None:
                values[i] = to_value(values[i])
        return values

    return decode


def _py(value, kind: str):
    if value is None or (not isinstance(value, (str, bytes, Decimal, list, dict)) and pd.isna(value)):
        return None
    if kind == "timestamp":
        return pd.Timestamp(value).to_pydatetime().replace(tzinfo=timezone.utc)
    if kind in ("int", "micros"):
        return int(value)
    if kind == "float":
        return float(value)
    return value


def _kind_of(dtype: T.DataType) -> str:
    if isinstance(dtype, (T.TimestampType, T.TimestampNTZType)):
        return "timestamp"
    if isinstance(dtype, (T.ByteType, T.ShortType, T.IntegerType, T.LongType)):
        return "int"
    if isinstance(dtype, (T.FloatType, T.DoubleType)):
        return "float"
    return "other"


def _values(series: pd.Series, kind: str) -> list:
    """A pandas column as Python values (None for nulls), vectorised where the column has no nulls."""
    if series.isna().any():
        return [_py(v, kind) for v in series.tolist()]
    if kind == "timestamp":
        utc = series.dt.tz_localize("UTC") if series.dt.tz is None else series.dt.tz_convert("UTC")
        with warnings.catch_warnings():  # pandas 2.2 warns that a Series will come back one day; a list is wanted
            warnings.simplefilter("ignore", FutureWarning)
            return list(utc.dt.to_pydatetime())
    if kind in ("int", "micros"):
        return [int(v) for v in series.tolist()]
    if kind == "float":
        return [float(v) for v in series.tolist()]
    return series.tolist()


def _json_default(value):
    if isinstance(value, datetime):
        return value.isoformat().replace("+00:00", "Z")
    if isinstance(value, (Decimal, date)):
        return str(value)
    return str(value)


class _Adapter:
    """Pandas in, pandas out, around one :class:`KeyedRuntime` per Python worker: a call handles one
    bucket of keys, each key through the runtime with its own state (kept as bytes per key)."""

    def __init__(self, job: KeyedJob, payload: T.StructType, main: T.StructType, output: T.StructType):
        self.job = job
        self.payload_names = payload.names
        self.payload_kinds = [_payload_kind(f.dataType) for f in payload.fields]
        self.decode = _decoder(self.payload_kinds)
        self.wire = _Wire(job, payload)
        self.main = main
        self.output = output
        self.dedup_ttl_ms = int(job.dedup_ttl.total_seconds() * 1000)
        self.processing = job.timers == PROCESSING_TIME
        self._runtime: KeyedRuntime | None = None
        self._files = None  # the current bucket's (element ids, their files, their original events) (a stream's)
        self._file_of: dict | None = None  # id -> (file, event), built on the bucket's first late element

    @property
    def runtime(self) -> KeyedRuntime:
        if self._runtime is None:
            self._runtime = KeyedRuntime(self.job.function, self.payload_names, self.main.names, self.dedup_ttl_ms,
                                         decode=self.decode)
        return self._runtime

    def by_key(self, pdf: pd.DataFrame | None, decoded: bool = False) -> dict[tuple, list[tuple[int, str, tuple]]]:
        """The bucket's events per key, in arrival order: (event time ms, dedup key, payload row); ``decoded``:
        rows of the values the function sees (decoded a column at a time), else of the compact wire values."""
        grouped: dict[tuple, list] = {}
        self._files = self._file_of = None
        if pdf is None or pdf.empty:
            return grouped
        wire = self.wire
        columns = {PAYLOAD + name: _values(pdf[PAYLOAD + name], kind)
                   for name, kind in zip(self.payload_names, self.payload_kinds)}
        keys = list(zip(*[[_DECODERS[kind](v) if v is not None and kind in _DECODERS else v for v in columns[c]]
                          for c, kind in zip(wire.keys, wire.key_kinds)]))
        times = [t // 1000 for t in columns[wire.time]] if wire.time_from_payload else _values(pdf["_t"], "int")
        ids = columns[wire.id] if wire.id_from_payload else pdf["_id"].tolist()
        if decoded:
            for c, kind in zip(columns, self.payload_kinds):
                if kind in _DECODERS:
                    columns[c] = _decoded(columns[c], kind)
        rows = list(zip(*columns.values())) if columns else [()] * len(pdf)
        for key, t, event_id, row in zip(keys, times, ids, rows):
            grouped.setdefault(key, []).append((t, event_id, row))
        if LATE_FILE in pdf.columns:  # (the elements' files: looked up only for a bucket with late elements)
            self._files = (ids, pdf[LATE_FILE], pdf[LATE_EVENT])
        return grouped

    def bounded_by_key(self, pdf: pd.DataFrame) -> "tuple[list[tuple[tuple, list]], int, int, int | None] | None":
        """A bounded call's events per key as the runtime's ``unique_sorted`` takes them: each id of a key once (its
        first delivery, as the runtime's own dedup keeps it) and in (event time, id) order, grouped, deduplicated and
        ordered by pandas and numpy a column at a time instead of an element at a time (the element-wise grouping was about
        half of a bounded bucket call's CPU for ``large_amount_alerts`` over the bench's payments; this path takes 0.86 of
        the call's CPU, and 0.94 for ``rolling_spend``, whose own function dominates). Also the call's inputs,
        duplicates and latest event time, duplicates included. None: a bucket this does not take (several key columns,
        an event time or id that is not a number or a text), which goes the element-wise way (:meth:`by_key`)."""
        wire = self.wire
        if len(wire.keys) != 1 or not wire.time_from_payload or not len(pdf):
            return None
        t_us = pdf[wire.time].to_numpy()
        id_values = pdf[wire.id].to_numpy()
        if t_us.dtype.kind != "i" or id_values.dtype != object:
            return None
        ids = id_values.tolist()
        if any(type(v) is not str for v in ids):  # (a NULL id: its order against a text is the runtime's to refuse)
            return None
        key_column = pdf[wire.keys[0]]
        if key_column.dtype != object and key_column.dtype.kind != "i":
            return None
        codes, uniques = pd.factorize(key_column, use_na_sentinel=False)
        t_ms = t_us // 1000
        n = len(ids)
        first = ~pd.DataFrame({"k": codes, "i": id_values}).duplicated().to_numpy()
        kept = np.flatnonzero(first)
        order = kept[np.lexsort((t_ms[kept], codes[kept]))]  # (by key, then time)
        sorted_codes, sorted_t = codes[order], t_ms[order]
        ties = np.flatnonzero((sorted_codes[1:] == sorted_codes[:-1]) & (sorted_t[1:] == sorted_t[:-1]))
        if len(ties):  # elements of one key and time: in id order, as the runtime sorts them
            start = ties[0]
            for i, j in zip(ties, [*ties[1:], -2]):
                if j != i + 1:  # a run of ties ends at i + 1
                    run = order[start:i + 2]
                    order[start:i + 2] = sorted(run.tolist(), key=ids.__getitem__)
                    start = j
        times = t_ms[order].tolist()
        ordered_ids = [ids[i] for i in order.tolist()]
        columns = []
        for name, kind in zip(self.payload_names, self.payload_kinds):
            column = pdf[PAYLOAD + name]
            values = column.to_numpy()[order].tolist() if column.dtype == object else None
            if values is None or None in values:
                values = _values(column.iloc[order], kind)
            if kind in _DECODERS:
                values = _decoded(values, kind)
            columns.append(values)
        rows = list(zip(*columns)) if columns else [()] * len(order)
        events = list(zip(times, ordered_ids, rows))
        key_kind = wire.key_kinds[0]
        key_values = _values(pd.Series(uniques, dtype=object), "other" if key_kind in _DECODERS else key_kind)
        if key_kind in _DECODERS:
            key_values = [None if v is None else _DECODERS[key_kind](v) for v in key_values]
        bounds = [0, *(np.flatnonzero(sorted_codes[1:] != sorted_codes[:-1]) + 1).tolist(), len(order)]
        grouped = [((key_values[sorted_codes[lo]],), events[lo:hi]) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
        return grouped, n, n - len(kept), int(t_ms.max())

    def quarantine(self, pdf: pd.DataFrame) -> pd.DataFrame:
        """The batch's invalid lines (they all travel under the NULL bucket, so one call sees them all), one
        row per distinct line of a file with its number of occurrences: counted here, the quarantine tables'
        writes need no shuffle of their own."""
        lines: dict[tuple, list] = {}
        for text in pdf[BAD]:
            line = json.loads(text)
            s, f, r, why = line.get("s"), line.get("f"), line.get("r"), line.get("why")
            seen = lines.get((s, f, r))
            if seen is None:
                lines[(s, f, r)] = [why, 1]
            else:
                seen[1] += 1
        rows = _Rows()
        for (s, f, r), (why, n) in lines.items():
            rows.side_row("q", None, {"_q_src": s, "_q_file": f, "_q_raw": r, "_q_reason": why, "_q_n": n})
        return self.frame(rows)

    def result_rows(self, key: tuple, result, rows: "_Rows") -> None:
        if result.outputs:
            rows.keys += [key] * len(result.outputs)
            rows.outs += result.outputs
        if not result.late:
            return
        if self._file_of is None and self._files is not None:
            ids, files, events = self._files
            self._file_of = dict(zip(ids, zip(files.tolist(), events.tolist())))
        file_of = self._file_of or {}
        for t, event_id, payload in result.late:
            fields = dict(zip(self.payload_names, self.decode(payload) if self.decode else payload))
            file, event = file_of.get(event_id, (None, None))
            if event is None:  # (a transform that carried nothing through: the columns it kept)
                event = json.dumps(fields, default=_json_default, sort_keys=True)
            source = fields.get("source")
            rows.side_row("late", key, {"_l_t": t, "_l_id": event_id, "_l_event": event, "_l_file": file,
                                        "_l_src": source if isinstance(source, str) else None})

    def frame(self, rows: "_Rows", alone: bool = False) -> pd.DataFrame:
        """The rows as a pandas frame Arrow converts to the output schema, built column by column: the main
        rows first (their values as the function returned them), then the side rows (one JSON text each).
        ``alone``: PySpark converts the frame by itself (a grouped map's call; a stateful one concatenates the
        frames of a batch's calls first), so a column may be held as Arrow already (see :func:`_column`)."""
        n_out, n_side = len(rows.outs), len(rows.side)
        n = n_out + n_side
        keys = rows.keys + rows.side_keys
        outs = list(zip(*rows.outs)) if n_out else [()] * len(self.main.names)
        fill = [None] * n_side
        columns = {"_kind": pd.Series(["out"] * n_out + rows.side_kinds, dtype=object)}
        for i, k in enumerate(self.job.keys):
            columns[KEY + k] = [None if key is None else key[i] for key in keys]
        for j, name in enumerate(self.main.names):
            columns[OUT + name] = [*outs[j], *fill]
        columns[SIDE] = [None] * n_out + rows.side
        # A frame made from a dict in the output's order: one also given its column list converts every
        # column to objects first (a Timestamp per value of a time column).
        data = {}
        for f in self.output.fields:
            values = columns[f.name]
            if isinstance(values, pd.Series):
                data[f.name] = values
            elif not any(v is not None for v in values):  # (``count(None)`` compares every value with None)
                data[f.name] = pd.Series(values, dtype=object)
            else:
                data[f.name] = _column(values, f.dataType, arrow=alone)
        return pd.DataFrame(data)

    def process_bucket(self, pdf: pd.DataFrame | None, view: "keys.BucketView | None", watermark: int, now_ms: int,
                       bounded: bool = False, commit=None) -> pd.DataFrame:
        """Run every key of the bucket that has events, or whose wake-up the watermark (or the processing
        clock) has reached, and return its output rows and one row of statistics. ``view``: the bucket's keys
        as they were before the batch (None: a bounded run, no state); ``commit(changed)`` stores the keys'
        new rows (None: the key is gone) and returns the names of the files it dropped."""
        if bounded and (fast := self.bounded_by_key(pdf)) is not None:
            return self._bounded_bucket(*fast, now_ms)
        events = self.by_key(pdf, decoded=bounded)  # (bounded: every element is delivered in this call)
        known = view.rows if view is not None else {}
        due: list = []
        if view is not None:
            if self.processing:  # (event time is polled at every batch: every key with an event-time wake-up)
                due = [k for k, r in known.items() if k not in events and (r[1] is not None or
                                                                            (r[2] is not None and r[2] <= now_ms))]
            else:
                due = [k for k in view.due(watermark) if k not in events]
        rows = _Rows()
        changed: dict = {}
        inputs = duplicates = 0
        max_t = None
        run = [*events, *due]
        # (a stream's worker keeps the states as the call leaves them, for the keys' next call: see ``keyed.files``)
        live = view is not None and len(run) <= LIVE_KEYS_MAX
        for key in run:
            row = known.get(key)
            result = self.runtime.process(key, row[0] if row else None, events.get(key, []), watermark, now_ms,
                                          bounded=bounded, decoded=bounded, live=live)
            inputs += result.inputs
            duplicates += result.duplicates
            if result.max_event_time_ms is not None:
                max_t = result.max_event_time_ms if max_t is None else max(max_t, result.max_event_time_ms)
            self.result_rows(key, result, rows)
            if result.state is None:
                if row is not None:
                    changed[key] = None
            else:
                changed[key] = (result.state, result.wakeup_ms, result.processing_wakeup_ms, result.stored)
        dropped = commit(changed) if commit is not None else []
        if inputs or rows or dropped:
            rows.side_row("stats", None, {"_s_in": inputs, "_s_dup": duplicates, "_s_max_t": max_t, "_s_wm": watermark,
                                          "_s_rm": ",".join(dropped) or None})
        return self.frame(rows, alone=bounded)

    def _bounded_bucket(self, grouped: list, inputs: int, duplicates: int, max_t: int | None, now_ms: int) -> pd.DataFrame:
        """:meth:`process_bucket` of a bounded call whose events :meth:`bounded_by_key` grouped."""
        rows = _Rows()
        process, result_rows = self.runtime.process, self.result_rows
        for key, elements in grouped:
            result_rows(key, process(key, None, elements, 0, now_ms, bounded=True, decoded=True, unique_sorted=True), rows)
        rows.side_row("stats", None, {"_s_in": inputs, "_s_dup": duplicates, "_s_max_t": max_t, "_s_wm": 0,
                                      "_s_rm": None})
        return self.frame(rows, alone=True)


class _Rows:
    """One call's output rows, kept column-wise: the main rows (their keys and the function's value tuples)
    and the side rows (kind, key, fields as one JSON text)."""

    __slots__ = ("keys", "outs", "side_kinds", "side_keys", "side")

    def __init__(self) -> None:
        self.keys: list[tuple] = []
        self.outs: list[tuple] = []
        self.side_kinds: list[str] = []
        self.side_keys: list[tuple | None] = []
        self.side: list[str | None] = []

    def __bool__(self) -> bool:
        return bool(self.outs or self.side)

    def side_row(self, kind: str, key: tuple | None, fields: dict) -> None:
        self.side_kinds.append(kind)
        self.side_keys.append(key)
        self.side.append(_side_json(fields))


def _side_json(fields: dict) -> str | None:
    side = {k: v for k, v in fields.items() if v is not None}
    return json.dumps(side, ensure_ascii=False, separators=(",", ":")) if side else None


def _column(values: list, dtype: T.DataType, arrow: bool = False):
    """A main-table column as pandas for PySpark's conversion to Arrow. ``arrow``: decimals that fit the type
    as they are become an Arrow column at once (a fifth of the time of rounding each one and converting the
    objects), which PySpark passes on whole when the frame is converted alone: a frame concatenated with
    others would hold it in several chunks, which PySpark's struct of columns refuses."""
    if isinstance(dtype, T.TimestampType):
        moments = [None if v is None else v if isinstance(v, datetime) else
                   datetime.fromtimestamp(int(v) / 1000, tz=timezone.utc) for v in values]
        return pd.Series(pd.to_datetime(moments, utc=True), dtype="datetime64[ns, UTC]").dt.tz_localize(None)
    if isinstance(dtype, T.DecimalType):
        if arrow:
            try:  # Arrow takes decimals (and ints) that fit the type as they are
                return pd.Series(pd.arrays.ArrowExtensionArray(
                    pa.array(values, type=pa.decimal128(dtype.precision, dtype.scale))))
            except (pa.ArrowException, TypeError, ValueError, OverflowError):  # (more digits than the scale, floats)
                pass
        quantum = Decimal(1).scaleb(-dtype.scale)
        return pd.Series([None if v is None else Decimal(v).quantize(quantum) for v in values], dtype=object)
    if isinstance(dtype, (T.LongType, T.IntegerType, T.ShortType, T.ByteType)):
        return pd.array([None if v is None else int(v) for v in values], dtype="Int64")
    if isinstance(dtype, (T.DoubleType, T.FloatType)):
        return pd.Series([float("nan") if v is None else float(v) for v in values], dtype="float64")
    return pd.Series(values, dtype=object)


def _plan(job: KeyedJob, parsed: DataFrame, stream: bool, buckets: int, labels: tuple[int, ...] | None = None):
    main = main_schema(job)
    frame, payload = _inputs(job, parsed, stream=stream, buckets=buckets, labels=labels)
    output = _output_schema(job, main, payload)
    return frame, output, _Adapter(job, payload, main, output)


def group_state(view: "keys.BucketView") -> bytes:
    """A bucket's value in Spark's state store: the names of its key files, how many keys it holds, its
    earliest event-time wake-up."""
    return pickle.dumps({"f": view.files, "n": len(view.rows), "w": view.earliest_wake()}, protocol=pickle.HIGHEST_PROTOCOL)


def stream_frame(job: KeyedJob, parsed: DataFrame, buckets: int, labels: tuple[int, ...] | None = None, *,
                 store: str, options: dict | None = None) -> DataFrame:
    """The keyed streaming query's output: rows of kind out | late | q | stats; keys in ``buckets`` groups
    (grouped by ``labels``, see ``bucket_labels``). Each key's state lives in ``store`` (``keyed.files``;
    ``options``: its file system's storage options); a bucket's group state names the files."""
    options = dict(options or {})
    encode, merge_after = group_state, keys.COMPACT_AFTER  # (bound here: what Spark ships is what the stream started with)
    merge = functools.partial(KeyedRuntime.merged, live=True)
    frame, output, adapter = _plan(job, parsed, stream=True, buckets=buckets, labels=labels)
    processing = job.timers == PROCESSING_TIME

    def process(key, pdfs: Iterator[pd.DataFrame], state):
        pyworkers.prepare()
        # A bucket's call builds and drops many small objects (state, rows); the worker's collection after
        # the task reclaims any cycle, so automatic collections in between would only re-walk live state.
        gc.disable()
        try:
            yield from _process(key, pdfs, state)
        finally:
            gc.enable()

    def _process(key, pdfs: Iterator[pd.DataFrame], state):
        parts = [p for p in pdfs if len(p)]
        pdf = pd.concat(parts, ignore_index=True) if parts else None
        if pd.isna(key[0]):  # invalid lines travel under the NULL bucket
            if pdf is not None:
                yield adapter.quarantine(pdf)
            return
        watermark = state.getCurrentWatermarkMs()
        now_ms = state.getCurrentProcessingTimeMs()
        bucket = int(key[0])
        saved = pickle.loads(bytes(state.get[0])) if state.exists else {}
        if "s" in saved:  # a bucket kept whole in the group state (checkpoints before the key files)
            view = keys.adopt(store, bucket, {k: (v, saved["w"].get(k), saved["p"].get(k)) for k, v in saved["s"].items()})
        else:
            view = keys.view(store, bucket, saved.get("f", []), options, merge=merge)

        def commit(changed: dict) -> list[str]:
            dropped = keys.commit(store, bucket, view, changed, options, whole="s" in saved, every=merge_after)
            return [keys.path_of(store, bucket, name) for name in dropped]

        out = adapter.process_bucket(pdf, view, watermark, now_ms, commit=commit)
        if not view.rows:
            if state.exists:
                state.remove()
        else:
            wake, processing_wake = view.earliest_wake(), view.earliest_processing_wake() if processing else None
            state.update((encode(view),))
            if processing:
                waits = ([processing_wake - now_ms] if processing_wake is not None else []) + ([1] if wake is not None else [])
                if waits:
                    state.setTimeoutDuration(max(1, min(waits)))
            elif wake is not None:
                state.setTimeoutTimestamp(max(wake - 1, watermark, 1))
        yield out

    timeout = GroupStateTimeout.ProcessingTimeTimeout if processing else GroupStateTimeout.EventTimeTimeout
    return _unpacked(frame.groupBy(BUCKET).applyInPandasWithState(process, output, _STATE_SCHEMA, "append", timeout))


def bounded_frame(job: KeyedJob, parsed: DataFrame) -> DataFrame:
    """The bounded twin: every key's whole input through the same runtime, perfect watermark."""
    frame, output, adapter = _plan(job, parsed, stream=False, buckets=BOUNDED_KEY_BUCKETS)
    started_ms = int(time.time() * 1000)

    def process(key, pdf: pd.DataFrame) -> pd.DataFrame:
        pyworkers.prepare()
        if pd.isna(key[0]):
            return adapter.quarantine(pdf)
        return adapter.process_bucket(pdf, None, 0, started_ms, bounded=True)

    return _unpacked(frame.groupBy(BUCKET).applyInPandas(process, output))


@dataclass(frozen=True)
class KeyedCounts:
    """What the keyed function's output of a batch (or bounded run) holds, counted in one pass over it."""

    outputs: int  # main-table rows
    late: int  # late elements (late side output rows)
    quarantined: dict[str, int]  # invalid lines per source
    inputs: int  # elements the function received (duplicates included)
    duplicates: int
    max_event_time_ms: int | None
    watermark_ms: int | None  # the watermark Spark gave the state function (None: no key ran)
    outputs_range_ms: tuple[int | None, int | None]  # of the output rows' time column
    late_range_ms: tuple[int | None, int | None]  # of the late elements' event times
    dropped: tuple[str, ...] = ()  # key files the batch dropped (merged or emptied): deleted after the next batch

    @property
    def bad(self) -> int:
        return sum(self.quarantined.values())


class KeyedOutput:
    """One batch's output of the keyed binding, typed: its counts, and one frame per table. ``frame`` is the
    binding's own output (its wire columns are known here and nowhere else); keep it cached while in use."""

    def __init__(self, job: KeyedJob, frame: DataFrame, main: T.StructType):
        self.job = job
        self.frame = frame
        self.main_schema = main
        self._parts: _Parts | None = None

    def counts(self) -> KeyedCounts:
        job = self.job
        row = self.frame.agg(*_statistics(job)).first()
        return KeyedCounts(
            outputs=row["out"], late=row["late"], quarantined={s.name: row[f"q_{s.name}"] for s in job.sources},
            inputs=row["inputs"], duplicates=row["dups"], max_event_time_ms=row["max_t"],
            watermark_ms=None if row["wm"] is None else int(row["wm"]),
            outputs_range_ms=(row["out_lo"], row["out_hi"]), late_range_ms=(row["late_lo"], row["late_hi"]),
            dropped=tuple(path for paths in row["dropped"] for path in paths.split(",")))

    def _split(self) -> _Parts:
        if self._parts is None:
            self._parts = split(self.job, self.frame, self.main_schema)
        return self._parts

    def main(self) -> DataFrame:
        return self._split()["main"]

    def late(self, watermark_ms: int | None) -> DataFrame:
        """The late side output's rows, each with the watermark it was late for and by how much."""
        return split(self.job, self.frame, self.main_schema, watermark_ms)["late"]

    def quarantine(self, source: str, written_by: str | None = None, batch_id: int | None = None) -> DataFrame:
        """The invalid lines of ``source``, with the commit that writes them (see the quarantine tables' schema)."""
        return self._split()[f"quarantine:{source}"].select(
            "*", F.lit(written_by).cast("string").alias("written_by"), F.lit(batch_id).cast("long").alias("batch_id"))


def _statistics(job: KeyedJob) -> list:
    """The counts and time ranges of the function's output (built once per job: each column is a few calls
    into the JVM)."""
    from .columns import once

    return once("keyed statistics", lambda: [
        F.count(F.when(F.col("_kind") == "out", 1)).alias("out"),
        F.count(F.when(F.col("_kind") == "late", 1)).alias("late"),
        F.coalesce(F.sum("_s_in"), F.lit(0)).alias("inputs"),
        F.coalesce(F.sum("_s_dup"), F.lit(0)).alias("dups"),
        F.max("_s_max_t").alias("max_t"),
        F.max("_s_wm").alias("wm"),
        F.collect_list("_s_rm").alias("dropped"),
        F.min(F.when(F.col("_kind") == "out", F.unix_millis(F.col(f"{OUT}{job.time_column}")))).alias("out_lo"),
        F.max(F.when(F.col("_kind") == "out", F.unix_millis(F.col(f"{OUT}{job.time_column}")))).alias("out_hi"),
        F.min(F.when(F.col("_kind") == "late", F.col("_l_t"))).alias("late_lo"),
        F.max(F.when(F.col("_kind") == "late", F.col("_l_t"))).alias("late_hi"),
        *[F.coalesce(F.sum(F.when((F.col("_kind") == "q") & (F.col("_q_src") == s.name), F.col("_q_n"))), F.lit(0))
          .alias(f"q_{s.name}") for s in job.sources],
    ], job)


class _Parts(dict):
    """Destination name -> frame, each built on first use (a frame is a few calls into the JVM; most
    batches write two or three of them)."""

    def __init__(self, builders: dict):
        super().__init__()
        self.builders = builders

    def __missing__(self, name: str) -> DataFrame:
        self[name] = frame = self.builders[name]()
        return frame


def split(job: KeyedJob, frame: DataFrame, main: T.StructType, watermark_ms: int | None = None) -> dict[str, DataFrame]:
    """The runtime's output rows by destination: main, late, quarantine (per source), stats. The late
    rows have the late-table schema every job shares (no window: a keyed element misses no window)."""

    def out() -> DataFrame:
        return frame.where(F.col("_kind") == "out").select(*[F.col(OUT + f.name).alias(f.name) for f in main.fields])

    def late() -> DataFrame:
        source = F.lit(job.source.name) if len(job.sources) == 1 else F.col("_l_src")
        return frame.where(F.col("_kind") == "late").select(
            *[F.col(KEY + k).alias(k) for k in job.keys],
            F.col("_l_id").alias(job.source.dedup_key),
            F.timestamp_millis(F.col("_l_t")).alias(job.source.event_time),
            F.lit(None).cast("timestamp").alias("window_start"), F.lit(None).cast("timestamp").alias("window_end"),
            F.lit(watermark_ms).cast("long").alias("watermark_ms"),
            (F.lit(watermark_ms) - F.col("_l_t")).cast("long").alias("late_by_ms"),
            source.alias("source"),
            F.coalesce(F.col("_l_file"), F.get_json_object("_l_event", "$.source_file")).alias("source_file"),
            F.col("_l_event").alias("event"),
        )

    def quarantine(name: str) -> DataFrame:
        return frame.where((F.col("_kind") == "q") & (F.col("_q_src") == name)).select(
            F.col("_q_src").alias("source"), F.col("_q_file").alias("source_file"), F.col("_q_raw").alias("raw_line"),
            F.col("_q_reason").alias("reason"), F.col("_q_n").alias("occurrences"), F.lit(job.name).alias("detected_by"),
        )

    return _Parts({"main": out, "late": late, "stats": lambda: frame.where(F.col("_kind") == "stats"),
                   **{f"quarantine:{s.name}": (lambda n=s.name: quarantine(n)) for s in job.sources}})
