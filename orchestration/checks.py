"""Asset checks of every job's tables. Each can run on demand from the UI; the sensors and the
bounded twin also report them on their own (as runless evaluations).

* ``reconciliation`` (main table, per day partition) is not here: each materialization of the bounded
  twin (``assets``) evaluates it, from its comparison made before it replaces the day;
* ``checkpoint_health`` (main table): stalled stream, growing backlog, state growth, corruption;
* ``freshness`` (main table): the last committed batch is recent, or no input waits;
* ``late_volume`` (late side output) and ``quarantine_volume`` (quarantine table): the share of
  late events and of quarantined lines stays under a bound.
"""


import time
from datetime import timedelta

import dagster as dg

from streaming.checkpoint.inspect import CheckpointReport, inspect_checkpoint, inspect_job
from streaming.declaration import Job, Source
from streaming.settings import Settings
from streaming.time import is_finite

from .resources import LakestreamResource
from .tables import QUARANTINE_SHARE_MAX, stream_key, table_key

LATE_SHARE_MAX = 0.05  # late events / events
STALE_AFTER = timedelta(hours=1)


def health_evaluation(job: Job, settings: Settings, now_ms: int | None = None,
                      report: CheckpointReport | None = None) -> dg.AssetCheckEvaluation:
    """``checkpoint_health`` of a job, from its checkpoint (pure Python through fsspec, no Spark)."""
    report = report or inspect_job(settings, job, now_ms=now_ms)
    h = report.health
    return dg.AssetCheckEvaluation(
        asset_key=stream_key(job), check_name="checkpoint_health", passed=h.status == "healthy",
        severity=dg.AssetCheckSeverity.ERROR if h.status == "error" else dg.AssetCheckSeverity.WARN,
        description="; ".join(h.messages) or "healthy",
        metadata={"status": h.status, "stalled": h.stalled, "backlog_growing": h.backlog_growing,
                  "state_growth": h.state_growth, "corrupt": h.corrupt, "in_flight": h.in_flight, "idle": h.idle,
                  "running": report.running is not None,
                  "longest_recent_batch_s": round(max(report.recent_batch_seconds, default=0.0), 1),
                  "last_committed_batch": report.last_committed_batch if report.last_committed_batch is not None else -1,
                  "files_waiting": report.files_waiting, "state_bytes": report.state_bytes,
                  **({"watermark": dg.MetadataValue.timestamp(report.watermark_ms / 1000)}
                     if is_finite(report.watermark_ms) else {})},
    )


def _totals(settings: Settings, job: Job) -> dict | None:
    """Cumulative statistics of the job's stream, from its checkpoint wherever it lives (fsspec)."""
    return inspect_checkpoint(job.name, settings.checkpoint_dir(job.name),
                              storage_options=settings.storage_options).totals


def job_checks(job: Job, partitions_def) -> list[dg.AssetChecksDefinition]:
    main = stream_key(job)  # checks of the stream, not of a day of its tables

    @dg.asset_check(asset=main, name="checkpoint_health", description="Stalled stream, growing backlog, state growth "
                    "or a corrupt checkpoint, read from the checkpoint (also reported every 30 s by a sensor).")
    def checkpoint_health(lakestream: LakestreamResource) -> dg.AssetCheckResult:
        e = health_evaluation(job, lakestream.settings())
        return dg.AssetCheckResult(passed=e.passed, severity=e.severity, description=e.description, metadata=e.metadata)

    @dg.asset_check(asset=main, name="freshness", description=f"The stream committed a batch within {STALE_AFTER}, or no "
                    "input waits for it.")
    def freshness(lakestream: LakestreamResource) -> dg.AssetCheckResult:
        settings = lakestream.settings()
        report = inspect_job(settings, job)
        age_s = (time.time() * 1000 - report.last_commit_ms) / 1000 if report.last_commit_ms else None
        stale = report.files_waiting > 0 and (age_s is None or age_s > STALE_AFTER.total_seconds())
        return dg.AssetCheckResult(passed=not stale, severity=dg.AssetCheckSeverity.WARN,
                                   metadata={"last_commit_age_s": age_s if age_s is not None else -1.0,
                                             "files_waiting": report.files_waiting},
                                   description="input waits and no recent batch" if stale else "fresh")

    @dg.asset_check(asset=main, name="late_volume",
                    description=f"Late events stay under {LATE_SHARE_MAX:.0%} of the events.")
    def late_volume(lakestream: LakestreamResource) -> dg.AssetCheckResult:
        totals = _totals(lakestream.settings(), job)
        if not totals or not totals["events"]:
            return dg.AssetCheckResult(passed=True, description="no events streamed yet")
        share = totals["late"] / totals["events"]
        return dg.AssetCheckResult(
            passed=share <= LATE_SHARE_MAX, severity=dg.AssetCheckSeverity.WARN,
            description=(f"{totals['late']:,} late row(s) ({'an event' if job.kind == 'keyed' else 'an event and a window it missed'}) "
                         f"for {totals['events']:,} "
                         f"events ({share:.2%}; the limit is {LATE_SHARE_MAX:.0%}), in {job.late_sink.name}"),
            metadata={"late": totals["late"], "events": totals["events"], "share_pct": round(share * 100, 3)})

    @dg.asset_check(asset=main, name="stream_supervisor", description="Whether the stream runs when it should; the "
                    "stream_supervisor sensor reports each restart here.")
    def stream_supervisor(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        from .streams import ACTIVE, DesiredState

        wanted = DesiredState(context.instance, job.name).get().get("state", "stopped")
        active = context.instance.get_runs(dg.RunsFilter(job_name=f"{job.name}_stream", statuses=ACTIVE), limit=1)
        ok = wanted != "running" or bool(active)
        return dg.AssetCheckResult(passed=ok, severity=dg.AssetCheckSeverity.WARN,
                                   metadata={"desired": wanted, "running": bool(active)},
                                   description="as desired" if ok else "should be running but is not")

    return [checkpoint_health, freshness, late_volume, stream_supervisor]


def quarantine_check(source: Source, jobs: list[Job]) -> dg.AssetChecksDefinition:
    readers = [j for j in jobs if source in j.sources]

    @dg.asset_check(asset=table_key(source.quarantine), name="quarantine_volume",
                    description=f"Quarantined lines stay under {QUARANTINE_SHARE_MAX:.0%} of the lines read.")
    def quarantine_volume(lakestream: LakestreamResource) -> dg.AssetCheckResult:
        settings = lakestream.settings()
        worst = None
        for job in readers:
            totals = _totals(settings, job)
            if totals and totals["lines"]:
                share = totals["quarantined"] / totals["lines"]
                if worst is None or share > worst[0]:
                    worst = (share, job.name, totals)
        if worst is None:
            return dg.AssetCheckResult(passed=True, description="nothing streamed yet")
        share, name, totals = worst
        return dg.AssetCheckResult(
            passed=share <= QUARANTINE_SHARE_MAX, severity=dg.AssetCheckSeverity.WARN,
            description=(f"{totals['quarantined']:,} of {totals['lines']:,} lines read by {name} quarantined "
                         f"({share:.2%}; the limit is {QUARANTINE_SHARE_MAX:.0%}); each with its file and reason in "
                         f"{source.quarantine.name}"),
            metadata={"share_pct": round(share * 100, 3), "quarantined": totals["quarantined"],
                      "lines": totals["lines"], "job": name})

    return quarantine_volume
