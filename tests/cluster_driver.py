"""Run in its own process against ``LAKESTREAM_SPARK_MASTER`` (the cluster test): a windowed and a
keyed job as streams (K files per batch), then the windowed job's bounded twin; the tables are
written to a JSON file as plain values for the test's oracle. Usage: HOME OUT K START_ISO"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timedelta

from batch.backfill import backfill
from streaming.project import get_job
from streaming.run.runner import run_stream
from streaming.spark.session import get_spark
from streaming.settings import Settings


def rows(spark, sql: str) -> list[list]:
    return [[str(v) if v is not None and not isinstance(v, (int, str)) else v for v in r] for r in spark.sql(sql).collect()]


def main() -> None:
    home, out, k, start = sys.argv[1], sys.argv[2], int(sys.argv[3]), datetime.fromisoformat(sys.argv[4])
    settings = Settings.load({**os.environ, "LAKESTREAM_HOME": home})  # LAKESTREAM_SPARK_MASTER from the environment
    spark = get_spark(settings)
    result = {"master": spark.sparkContext.master}
    windows = ("SELECT user_id, unix_millis(window_start), event_count, approved_count, declined_count, amount_sum "
               "FROM lake.payments.purchase_metrics")
    for name in ("purchase_metrics", "large_amount_alerts"):
        job_settings = settings.with_job(name, max_files_per_trigger=k)
        report = run_stream(spark, job_settings, get_job(name, job_settings), available_now=True, progress=None,
                            install_signal_handlers=False)
        result[f"{name}:batches"] = report.batches
    result["windows"] = rows(spark, windows)
    result["late"] = [r[0] for r in rows(spark, "SELECT event_id FROM lake.payments.purchase_metrics_late")]
    result["alerts"] = rows(spark, "SELECT card_id, event_id, previous_event_id FROM lake.fraud.large_amount_alerts")
    result["alerts_late"] = [r[0] for r in rows(spark, "SELECT event_id FROM lake.fraud.large_amount_alerts_late")]
    backfill(spark, settings, get_job("purchase_metrics", settings), start, start + timedelta(days=1), progress=None,
             force=True)
    result["bounded"] = rows(spark, windows)
    # block managers: the driver's and one per executor that joined (they register as the jobs start)
    result["executors"] = spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size()  # noqa: SLF001
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
