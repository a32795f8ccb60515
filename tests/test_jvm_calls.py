"""Lookups PySpark repeats at every use, made once per process: Spark's ``functions`` and other static methods,
the column of a name, a Java class by its full name (``spark/jvm.py``)."""

from __future__ import annotations

import threading

from pyspark.sql import functions as F

from streaming.spark.jvm import java_class


def _sent(spark, action) -> list[str]:
    """The py4j commands ``action`` sends from this thread (their first two lines: kind and target)."""
    client_class = type(spark.sparkContext._gateway._gateway_client)  # noqa: SLF001
    original = client_class.send_command
    me = threading.current_thread()
    sent: list[str] = []

    def counting(self, command, *args, **kwargs):
        if threading.current_thread() is me:
            sent.append(" ".join(command.split("\n")[:2]))
        return original(self, command, *args, **kwargs)

    client_class.send_command = counting
    try:
        action()
    finally:
        client_class.send_command = original
    return sent


def test_a_function_is_one_call_and_a_named_column_no_call_once_made(spark):
    F.col("a_name_used_twice"), F.lit(1)  # (the first use of each looks it up)
    assert _sent(spark, lambda: [F.col("a_name_used_twice") for _ in range(3)]) == []
    sent = _sent(spark, lambda: F.lit(7))
    assert len(sent) == 1 and sent[0].startswith("c "), sent  # the call itself, no lookup of `functions` or `lit`


def test_shared_columns_give_the_right_rows_from_threads_at_once(spark):
    frame = spark.range(1000).select(F.col("id"), (F.col("id") % 7).alias("k"))
    want = {k: sum(i for i in range(1000) if i % 7 == k) for k in range(7)}  # the oracle: plain Python
    got: list[dict] = []
    errors: list[BaseException] = []

    def run():
        try:
            rows = frame.groupBy(F.col("k")).agg(F.sum(F.col("id")).alias("s")).collect()
            got.append({r["k"]: r["s"] for r in rows})
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == [want] * 4


def test_a_java_class_by_its_full_name_costs_no_lookup(spark):
    jvm = spark.sparkContext._jvm  # noqa: SLF001
    path = java_class(jvm, "org.apache.hadoop.fs.Path")
    assert path("/landing/x/part-1.json").getName() == "part-1.json"
    sent = _sent(spark, lambda: path("/a/b"))
    assert len(sent) == 1 and sent[0].startswith("i "), sent  # the constructor alone, no package walk
