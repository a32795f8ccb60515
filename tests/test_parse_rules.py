"""Each field's rule decides a record's reason, whatever the values hold: random records over values labelled
valid or invalid by hand (the oracle), including the character the parse joins values with, a rule whose ``.``
matches it, missing optional fields and unicode. The parse checks a record against one joined expression and
falls back to field-by-field checks when it does not match; both paths must give the first broken rule in
declaration order, as the labels say."""

from __future__ import annotations

import json
import random

from pyspark.sql import functions as F

from streaming.declaration import Field, Source
from streaming.io.parse import parse

SEP = "\u0001"  # (the parse's joining character)
FIELDS = (
    Field("id", "string", pattern=r"^[a-z0-9][a-z0-9_.:-]{0,10}$"),
    Field("code", "string", pattern=r"^[A-Z]{3}$"),
    Field("anything", "string", pattern=r"^.*$"),  # `.` matches the joining character
    Field("n", "int"),
    Field("amount", "decimal"),
    Field("t", "timestamp"),
    Field("ip", "ip"),
    Field("tail", "string", pattern=r"^x+$", required=False),
    Field("note", "string", pattern=r"(?i)^ok$", required=False),  # not joinable: checked on its own
)
RULES = Source(name="rules", fields=FIELDS, event_time="t", dedup_key="id")

POOLS = {  # value -> valid?  (None: the key is left out)
    "id": {"a": True, "a-b.c:d_e": True, "0": True, "a" * 11: True, "a" * 12: False, "": False, "-a": False,
           f"a{SEP}b": False, SEP: False, "é": False, "A": False, "a b": False},
    "code": {"EUR": True, "USD": True, "EU": False, "EURO": False, f"EU{SEP}": False, "eur": False, "": False},
    "anything": {"": True, "x": True, f"a{SEP}b": True, SEP: True, f"{SEP}{SEP}": True, "ünïcødé ✓": True,
                 "tab\there": True},
    "n": {"0": True, "-12": True, "+7": True, "2147483647": True, "2147483648": False, "1.5": False, "": False,
          f"1{SEP}": False, "x": False},
    "amount": {"0": True, "12.50": True, "999999999999.99": True, "1.234": False, "-1": False, "1e3": False,
               "": False, f"1{SEP}2": False},
    "t": {"2026-11-20T10:00:00Z": True, "2026-11-20T10:00:00.123456Z": True, "2026-11-20T10:00:00+01:00": True,
          "2026-02-30T00:00:00Z": False, "2026-11-20 10:00:00": False, "2026-11-20T10:00:00": False,
          f"2026-11-20T10:00:00Z{SEP}": False},
    "ip": {"10.0.0.1": True, "255.255.255.255": True, "256.0.0.1": False, "1.2.3": False, f"1.2.3.4{SEP}": False},
    "tail": {None: True, "x": True, "xxx": True, "": False, "xy": False, f"x{SEP}x": False},
    "note": {None: True, "ok": True, "OK": True, "no": False},
}


def _record(rng: random.Random) -> tuple[str, str | None]:
    """A JSON line and the oracle's verdict: the first field, in declaration order, whose value is invalid."""
    record, first_bad = {}, None
    for field in FIELDS:
        pool = POOLS[field.name]
        # mostly valid values, so whole records pass the joined expression as well as fail it
        choices = [v for v, ok in pool.items() if ok] if rng.random() < 0.85 else list(pool)
        value = rng.choice(choices)
        if value is not None:
            record[field.name] = value
        if first_bad is None and not pool[value]:
            first_bad = field.name
    return json.dumps(record, ensure_ascii=rng.random() < 0.5), first_bad


def test_the_first_broken_rule_is_the_reason_for_random_records(spark):
    rng = random.Random(20261127)
    lines = [_record(rng) for _ in range(3000)]
    assert sum(1 for _, bad in lines if bad is None) > 1000 and sum(1 for _, bad in lines if bad) > 500
    raw = spark.createDataFrame([(text, f"{i:06d}") for i, (text, _) in enumerate(lines)], "value string, source_file string")
    got = {r["source_file"]: r["_reason"] for r in parse(raw, RULES).select("source_file", "_reason").collect()}
    assert len(got) == len(lines)
    wrong = []
    for i, (text, bad) in enumerate(lines):
        reason = got[f"{i:06d}"]
        ok = reason is None if bad is None else reason is not None and reason.startswith(f"invalid {bad} (expected ")
        if not ok:
            wrong.append((text, bad, reason))
    assert not wrong, f"{len(wrong)} record(s) with the wrong verdict, e.g. {wrong[:3]}"


def _instant(rng: random.Random) -> tuple[str, int | None]:
    """An ISO-8601 value and the oracle's instant (microseconds since the epoch; None: the rule rejects it)."""
    from datetime import datetime, timedelta, timezone

    if rng.random() < 0.1:  # values that look like one and are not
        return rng.choice(["2026-02-30T00:00:00Z", "2025-02-29T12:00:00Z", "2026-11-20T24:00:00Z",
                           "2026-11-20T10:60:00Z", "2026-11-20T10:00:00ZZ", "2026-11-20T10:00:00.1234567Z",
                           "2026-11-20Z", "2026-11-20T10:00Z", "Z", "2026-11-20T10:00:00z"]), None
    t = datetime(1970, 1, 1, tzinfo=timezone.utc) + timedelta(microseconds=rng.randrange(0, 130 * 365 * 86400 * 10**6))
    digits = rng.choice([0, 0, 1, 3, 6])
    t = t.replace(microsecond=t.microsecond // 10 ** (6 - digits) * 10 ** (6 - digits))
    offset = rng.choice([0, 0, 0, 60, -330, 14 * 60, -12 * 60])
    local = (t + timedelta(minutes=offset)).strftime("%Y-%m-%dT%H:%M:%S")
    if digits:
        local += "." + f"{t.microsecond:06d}"[:digits]
    zone = "Z" if offset == 0 and rng.random() < 0.8 else f"{'+' if offset >= 0 else '-'}{abs(offset) // 60:02d}:{abs(offset) % 60:02d}"
    return local + zone, (t - datetime(1970, 1, 1, tzinfo=timezone.utc)) // timedelta(microseconds=1)


def test_timestamps_parse_to_the_instant_they_name_whatever_their_zone(spark):
    """A timestamp field's value is the instant the ISO-8601 text names, in UTC ('Z') or at an offset, with 0-6
    fraction digits, from 1970 to 2100; a text that only looks like one is quarantined (the oracle: Python's
    calendar arithmetic)."""
    rng = random.Random(20261128)
    cases = [_instant(rng) for _ in range(4000)]
    assert sum(1 for v, _ in cases if v.endswith("Z")) > 1200 and sum(1 for _, us in cases if us is None) > 200
    source = Source(name="times", fields=(Field("id", "string"), Field("t", "timestamp")), event_time="t", dedup_key="id")
    raw = spark.createDataFrame([(json.dumps({"id": f"{i:05d}", "t": v}), "f") for i, (v, _) in enumerate(cases)],
                                "value string, source_file string")
    got = {r["id"]: (r["us"], r["_reason"]) for r in
           parse(raw, source).select("id", F.unix_micros("t").alias("us"), "_reason").collect()}
    wrong = []
    for i, (value, us) in enumerate(cases):
        parsed, reason = got[f"{i:05d}"]
        ok = reason is not None if us is None else (parsed, reason) == (us, None)
        if not ok:
            wrong.append((value, us, parsed, reason))
    assert not wrong, f"{len(wrong)} value(s) parsed wrongly, e.g. {wrong[:3]}"
