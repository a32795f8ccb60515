"""The lake's tables and landing folders as Dagster assets: keys, daily partitions, specs, columns.

Column schemas come from the tables' own metadata on disk (Iceberg's metadata JSON, Delta's log),
read in plain Python when the definitions load: no SparkSession in the code server.
"""


import json
from datetime import date, datetime, timedelta, timezone

import dagster as dg

from streaming.checkpoint.inspect import inspect_checkpoint
from streaming.checkpoint.tree import landing_files
from streaming.declaration import Job, KeyedJob, Source, Table
from streaming.io.sources import kind_of
from streaming.settings import Settings

from .resources import LakestreamResource

DAY = timedelta(days=1)
STREAM_TAG = "lakestream/stream"  # on a stream's runs: its job (an application: "streams"); one run per value
QUARANTINE_SHARE_MAX = 0.02  # quarantined lines / lines read: the quarantine_volume check's limit


def table_key(table: Table | str) -> dg.AssetKey:
    return dg.AssetKey((table.name if isinstance(table, Table) else table).split("."))


def landing_key(source: str) -> dg.AssetKey:
    return dg.AssetKey(["landing", source])


def input_key(source: Source) -> dg.AssetKey:
    """The asset a source's records come from: its table (a table source: lineage from the job that
    writes it) or its landing folder."""
    upstream = kind_of(source).upstream_table(source)
    return table_key(upstream) if upstream else landing_key(source.name)


def landing_sources(jobs: list[Job]) -> list[Source]:
    """The sources of ``jobs`` read from a landing folder (observed as landing assets), each once."""
    sources = {s.name: s for j in jobs for s in j.sources}
    return [s for s in sources.values() if kind_of(s).lands_in_folder]


def partitions(settings: Settings) -> dg.DailyPartitionsDefinition:
    """Days of event time (UTC), from ``partitions_start`` to today."""
    return dg.DailyPartitionsDefinition(start_date=settings.partitions_start, end_offset=1)


def day_keys(first_ms: int | None, last_ms: int | None, partitions_def: dg.DailyPartitionsDefinition | None) -> list[str]:
    """The day partitions ``[first_ms, last_ms]`` spans that exist in ``partitions_def``."""
    if first_ms is None or last_ms is None:
        return []
    first = datetime.fromtimestamp(first_ms / 1000, tz=timezone.utc).date()
    last = datetime.fromtimestamp(last_ms / 1000, tz=timezone.utc).date()
    start = date.fromisoformat(partitions_def.start.strftime("%Y-%m-%d")) if partitions_def else first
    today = datetime.now(timezone.utc).date()
    days, day = [], max(first, start)
    while day <= min(last, today):
        days.append(day.isoformat())
        day += DAY
    return days


def columns(settings: Settings, table: Table, fmt: str) -> dg.TableSchema | None:
    """The table's columns from its metadata files (Iceberg hadoop catalog or Delta log, on local disk or
    an object store through fsspec), or None."""
    from streaming.checkpoint.tree import Tree

    name = table.name.split(".")[2]
    try:
        if fmt == "delta":
            log = Tree(f"{settings.delta_root.rstrip('/')}/{table.domain}/{name}/_delta_log", settings.storage_options)
            for entry in sorted((n for n in log.names() if n.endswith(".json")), reverse=True):
                for line in log.read_text(entry).splitlines():
                    meta = json.loads(line).get("metaData")
                    if meta:
                        fields = json.loads(meta["schemaString"])["fields"]
                        return dg.TableSchema(columns=[dg.TableColumn(f["name"], _type(f["type"])) for f in fields])
            return None
        warehouse = (settings.iceberg.warehouse or settings.warehouse).rstrip("/")
        meta_dir = Tree(f"{warehouse}/{table.domain}/{name}/metadata", settings.storage_options)
        if not meta_dir.exists("version-hint.text"):
            return None
        meta = json.loads(meta_dir.read_text(f"v{meta_dir.read_text('version-hint.text').strip()}.metadata.json"))
        current = next(s for s in meta["schemas"] if s["schema-id"] == meta["current-schema-id"])
        return dg.TableSchema(columns=[dg.TableColumn(f["name"], _type(f["type"])) for f in current["fields"]])
    except (OSError, ValueError, KeyError, StopIteration, UnicodeDecodeError):
        return None


def _type(value) -> str:
    return value if isinstance(value, str) else value.get("type", "struct")


def stream_key(job: Job) -> dg.AssetKey:
    return dg.AssetKey(["streams", job.name])


def stream_spec(job: Job) -> dg.AssetSpec:
    """The stream of a job as an asset of its own (not materializable: it runs): the checks about the
    stream (checkpoint health, freshness, supervisor, late volume) live here, unpartitioned, apart from the
    day-partitioned tables it writes."""
    return dg.AssetSpec(
        stream_key(job), deps=[input_key(s) for s in job.sources], group_name="streams", kinds={"spark"},
        owners=[f"team:{job.owner}"],
        description=f"The stream of {job.name} (`{job.name}_stream`, or `lakestream run {job.name}`): its "
                    f"checkpoint, health and supervision. It writes {job.sink.name} and {job.late_sink.name}.",
        metadata={"job": job.name}, tags={"lakestream/role": "stream"},
    )


def table_spec(settings: Settings, job: Job, table: Table, role: str, partitions_def) -> dg.AssetSpec:
    fmt = settings.format_of(job.name)
    schema = columns(settings, table, fmt)
    what = {"main": job.description or job.name,
            "late": f"Late side output of {job.name}: events that arrived after the watermark had passed their window; "
                    "each row says which window it missed and by how much."}[role]
    metadata = {"table": table.name, "format": fmt, "keys": ", ".join(job.keys), "job": job.name}
    if schema is not None:
        metadata["dagster/column_schema"] = schema
    return dg.AssetSpec(
        table_key(table), deps=[*[input_key(s) for s in job.sources], stream_key(job)], description=what,
        group_name=table.domain, owners=[f"team:{job.owner}"], kinds={fmt, "spark"}, metadata=metadata,
        partitions_def=partitions_def, tags={"lakestream/role": role},
        freshness_policy=freshness_policy(settings, job) if role == "main" else None,
    )


MATERIALIZE_EVERY_S = 10  # (the stream run's default merge interval of materializations: streams.StreamConfig)


def freshness_policy(settings: Settings, job: Job) -> dg.FreshnessPolicy | None:
    """Dagster's freshness policy of a windowed job's main table, evaluated by Dagster's daemon. A window is
    written once the watermark passes its end, so a running stream with steady input adds rows every window
    step (sessions: gap), plus the out-of-orderness, the trigger and the merge of materializations: a warning
    after that, a failure after twice that. A stream that commits batches without moving its watermark writes
    no window and refreshes nothing: the policy follows event time, not commits. Keyed jobs write when their
    events and timers call for it: no cadence to expect, no policy."""
    if isinstance(job, KeyedJob):
        return None
    trigger = settings.job(job.name).trigger_interval
    expected = timedelta(milliseconds=job.window.cadence_ms + job.watermark.out_of_orderness_ms) \
        + (trigger or timedelta(0)) + timedelta(seconds=MATERIALIZE_EVERY_S + 30)
    return dg.FreshnessPolicy.time_window(fail_window=2 * expected, warn_window=expected)


def quarantine_spec(settings: Settings, source: Source) -> dg.AssetSpec:
    return dg.AssetSpec(
        table_key(source.quarantine), deps=[input_key(source)], group_name="quarantine",
        description=f"Lines of the {source.name} landing zone that are not valid records, with the reason, the raw "
                    "line and the file; written by every job that reads the source (detected_by).",
        kinds={settings.format, "spark"}, owners=["team:data-platform"],
        metadata={"table": source.quarantine.name}, tags={"lakestream/role": "quarantine"},
    )


_FILES = {"json": "JSON-lines files", "csv": "CSV files", "parquet": "Parquet files"}


def landing_assets(sources: list[Source], jobs: list[Job]) -> dg.AssetsDefinition:
    """The landing folders as observable source assets: files and bytes present and still pending."""
    specs = [dg.AssetSpec(landing_key(s.name), group_name="landing", kinds={s.format},
                          description=f"{_FILES[s.format]} of {s.name} records, filled in arrival order "
                                      f"({s.location or '$LAKESTREAM_HOME/landing/' + s.name}).")
             for s in sources if kind_of(s).lands_in_folder]

    @dg.multi_observable_source_asset(specs=specs, name="landing_zone",
                                      description="Count the landing zone's files and what the streams have not read.")
    def observe(lakestream: LakestreamResource):
        settings = lakestream.settings()
        for source in (s for s in sources if kind_of(s).lands_in_folder):
            metadata, version = landing_observation(settings, source, jobs)
            yield dg.ObserveResult(asset_key=landing_key(source.name), metadata=metadata,
                                   data_version=dg.DataVersion(version))

    return observe


def landing_observation(settings: Settings, source: Source, jobs: list[Job]) -> tuple[dict, str]:
    """What a landing folder holds (files, bytes, and what its slowest reader has not read yet), and a
    data version that changes when files arrive. Pure Python (fsspec), no Spark."""
    folder = kind_of(source).landing_folder(settings, source)
    try:
        files = landing_files(folder, settings.storage_options)  # key -> (bytes, mtime ms)
    except (ValueError, OSError) as exc:
        raise dg.Failure(f"cannot list {folder}: {exc}") from None
    readers = [j for j in jobs if source in j.sources]
    pending = [inspect_checkpoint(j.name, settings.checkpoint_dir(j.name), folder,
                                  storage_options=settings.storage_options) for j in readers]
    waiting = max(pending, key=lambda r: r.files_waiting, default=None)
    newest = max((mtime for _, mtime in files.values()), default=0)
    metadata = {"files": len(files), "bytes": sum(size for size, _ in files.values()),
                "pending_files": waiting.files_waiting if waiting else len(files),
                "pending_bytes": waiting.bytes_waiting if waiting else 0,
                "slowest_reader": waiting.job if waiting else "none"}
    return metadata, f"{len(files)}-{newest}"
