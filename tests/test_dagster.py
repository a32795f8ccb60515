"""Dagster definitions load, and materializing the stream in-process writes the Iceberg table."""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from orchestration.definitions import build_definitions
from tests import oracle


def test_definitions_load_with_lineage_from_landing_to_the_table(lake):
    defs = build_definitions(lake, home=str(lake.home))
    dg.Definitions.validate_loadable(defs)
    graph = defs.resolve_asset_graph()
    table = dg.AssetKey(["lake", "payments", "purchase_metrics"])
    assert dg.AssetKey(["landing", "payments"]) in graph.get(table).parent_keys
    assert defs.resolve_job_def("purchase_metrics_stream") is not None


def test_materializing_the_stream_through_dagster_writes_the_table(spark, small_landing):
    defs = build_definitions(small_landing, home=str(small_landing.home))
    table = dg.AssetKey(["lake", "payments", "purchase_metrics"])
    with dg.instance_for_test() as instance:
        result = defs.resolve_job_def("purchase_metrics_stream").execute_in_process(
            instance=instance,
            run_config={"ops": {"purchase_metrics": {"config": {"mode": "available_now"}}}},
        )
        assert result.success
        event = instance.get_latest_materialization_event(table)
    landing = Path(small_landing.landing_dir("payments"))
    truth = oracle.replay_stream([[l for p in oracle.files_in_arrival_order(landing) for l in oracle.read_lines(p)]])
    rows = spark.table("lake.payments.purchase_metrics").count()
    assert rows == len(truth.closed) > 0  # one micro-batch: exactly the windows closed by its watermark
    assert event.asset_materialization.metadata["rows_written"].value == rows
