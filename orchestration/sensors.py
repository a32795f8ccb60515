"""Sensors: checkpoint health every 30 s, and a supervisor that restarts crashed streams.

* ``checkpoint_health`` inspects every job's checkpoint (pure Python) and reports the
  ``checkpoint_health`` asset check of its table when the verdict changes (and at least every
  10 minutes), as a runless evaluation: no run, no Spark; and observes the landing folders (files,
  bytes, what is pending) when they change.
* ``stream_supervisor``: a stream that should be running (``DesiredState``) but has no active run
  is started again from its checkpoint (a multi-job application as a whole, with those of its
  jobs that should run). A run that ended cleanly (rolled over, stopped for a
  savepoint) is followed at once; after a failed run the restart waits ``2**(n-1) x 30 s`` for the
  n-th consecutive failure and gives up after ``MAX_ATTEMPTS``. Every restart carries its reason
  and attempt in the run's tags and is reported as the table's ``stream_supervisor`` check. A run
  terminated from the UI is a request to stop: it is not restarted. A run Dagster still calls started
  whose process is gone (a killed pod, a rebooted machine: nobody left to report it) is marked failed
  with the reason, then restarted as a crash (``dead_run``).
"""


import json
import socket
import time

import dagster as dg

from streaming.checkpoint.inspect import inspect_job
from streaming.checkpoint.lease import Lease, process_alive
from streaming.declaration import Job

from .checks import health_evaluation
from .resources import LakestreamResource
from .streams import ACTIVE, APP_JOB, APP_OP, JOBS_TAG, PROCESS_TAG, DesiredState, durations_of, jobs_of_run
from .tables import landing_key, landing_observation, landing_sources, stream_key

MAX_ATTEMPTS = 5
DEAD_AFTER_S = 30  # a started run whose process is gone and that logged nothing this long is failed
BACKOFF_S = 30.0
REPORT_EVERY_S = 600


def health_sensor(jobs: list[Job]) -> dg.SensorDefinition:
    @dg.sensor(name="checkpoint_health", minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING,
               description="Inspect every stream's checkpoint and report its checkpoint_health check on change.")
    def checkpoint_health(context: dg.SensorEvaluationContext, lakestream: LakestreamResource):
        settings = lakestream.settings()
        cursor = json.loads(context.cursor or "{}")
        now = time.time()
        reported = []
        for job in jobs:
            report = inspect_job(settings, job)  # through fsspec: local disk and object stores alike
            if not report.exists:
                continue
            evaluation = health_evaluation(job, settings, report=report)
            status = evaluation.metadata["status"].value
            last = cursor.get(job.name)
            if last is None or last[0] != status or now - last[1] > REPORT_EVERY_S:
                context.instance.report_runless_asset_event(evaluation)
                cursor[job.name] = [status, now]
                reported.append(f"{job.name}: {status}")
        # The landing folders, observed on the same tick (runless observations: no run, no Spark).
        for source in landing_sources(jobs):
            try:
                metadata, version = landing_observation(settings, source, jobs)
            except dg.Failure:
                continue  # not there yet
            key = f"landing:{source.name}"
            last = cursor.get(key)
            if last is None or last[0] != version or now - last[1] > REPORT_EVERY_S:
                context.instance.report_runless_asset_event(dg.AssetObservation(
                    asset_key=landing_key(source.name), metadata=metadata, tags={"dagster/data_version": version}))
                cursor[key] = [version, now]
                reported.append(f"landing {source.name}: {metadata['files']} file(s)")
        context.update_cursor(json.dumps(cursor))
        return dg.SkipReason("reported " + ", ".join(reported) if reported else "no change")

    return checkpoint_health


def supervisor_sensor(jobs: list[Job], stream_jobs: list[dg.JobDefinition]) -> dg.SensorDefinition:
    @dg.sensor(name="stream_supervisor", minimum_interval_seconds=30, jobs=stream_jobs,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Restart streams that should be running and are not (exponential backoff).")
    def stream_supervisor(context: dg.SensorEvaluationContext, lakestream: LakestreamResource):
        settings = lakestream.settings()
        requests = []
        covered: set[str] = set()  # jobs an application restart of this tick already covers
        names = [j.name for j in jobs]
        for job in jobs:
            if job.name in covered:
                continue
            lease = Lease(settings.checkpoint_dir(job.name), settings.storage_options, job=job.name)
            request = supervise(context.instance, job, all_jobs=names, lease=lease)
            if request is not None:
                requests.append(request)
                covered.update(request.tags.get(JOBS_TAG, job.name).split(","))
        return requests or dg.SkipReason("every stream that should run is running")

    return stream_supervisor


def _stream_runs(instance: dg.DagsterInstance, job: str, all_jobs: list[str], statuses=None, limit: int = 20):
    """The runs (newest first) that ran ``job``: its own ``<job>_stream`` runs and applications with it."""
    records = []
    for name in (f"{job}_stream", APP_JOB):
        records += instance.get_run_records(dg.RunsFilter(job_name=name, statuses=statuses), limit=limit)
    records = [r for r in records if job in jobs_of_run(r.dagster_run, all_jobs)]
    return sorted(records, key=lambda r: r.create_timestamp, reverse=True)[:limit]


def dead_run(instance: dg.DagsterInstance, record, lease: Lease | None = None, now: float | None = None) -> str | None:
    """Why a started stream run is dead although Dagster says it runs (its pod was killed, the machine
    rebooted: nothing was left to report the failure), or None. Its process (``PROCESS_TAG``) is gone:
    on this host, by its pid and start time; on another, when the checkpoint's lease it holds was not
    renewed for the lease's ttl. And the run logged nothing for ``DEAD_AFTER_S`` (a run whose stream
    just ended cleanly reports its own end within that)."""
    now = time.time() if now is None else now
    tag = record.dagster_run.tags.get(PROCESS_TAG, "")
    host, _, rest = tag.partition(":")
    pid, _, started = rest.partition(":")
    if not pid.isdigit():
        return None  # (not yet streaming, or a run of an earlier lakestream)
    if host == socket.gethostname():
        if process_alive(int(pid), started or None):
            return None
        why = f"its process (pid {pid} on {host}) is gone"
    else:
        holder = lease.current() if lease is not None else None
        if holder is None or (holder.host, str(holder.pid)) != (host, pid) or holder.alive(int(now * 1000)):
            return None
        why = f"its process (pid {pid} on {host}) last renewed the checkpoint's lease {now - holder.renewed_ms / 1000:.0f} s ago"
    events = instance.get_records_for_run(record.dagster_run.run_id, limit=1, ascending=False).records
    last = events[0].timestamp if events else record.update_timestamp.timestamp()
    if now - last < DEAD_AFTER_S:
        return None
    return f"{why} and the run logged nothing for {now - last:.0f} s: marked failed by the stream supervisor"


def supervise(instance: dg.DagsterInstance, job: Job, now: float | None = None,
              all_jobs: list[str] | None = None, lease: Lease | None = None) -> dg.RunRequest | None:
    """The run request that restarts ``job``'s stream (or the application it ran in), if it should
    be running and is not. A started run whose process is gone (:func:`dead_run`) is marked failed
    first, so it is restarted as a crash."""
    now = time.time() if now is None else now
    all_jobs = all_jobs or [job.name]
    for record in _stream_runs(instance, job.name, all_jobs, statuses=[dg.DagsterRunStatus.STARTED], limit=5):
        why = dead_run(instance, record, lease, now)
        if why:
            instance.report_run_failed(record.dagster_run, message=why)
    desired = DesiredState(instance, job.name)
    wanted = desired.get()
    if wanted.get("state") != "running":
        return None
    if _stream_runs(instance, job.name, all_jobs, statuses=ACTIVE, limit=5):
        return None
    # A run canceled before it started (a second launch, terminated while it waited in the queue) asked
    # nothing of the stream: only a run that ran and was terminated is a request to stop.
    records = [r for r in _stream_runs(instance, job.name, all_jobs)
               if not (r.dagster_run.status == dg.DagsterRunStatus.CANCELED and r.start_time is None)]
    last = records[0] if records else None
    if last is not None and last.dagster_run.status == dg.DagsterRunStatus.CANCELED:
        desired.set("stopped", reason="terminated", run_id=last.dagster_run.run_id)  # a stop request, not a crash
        return None
    failures = 0
    for record in records:
        if record.dagster_run.status != dg.DagsterRunStatus.FAILURE:
            break
        failures += 1
    application = [n for n in wanted.get("application") or [] if n in all_jobs]
    name = APP_JOB if application else f"{job.name}_stream"
    if failures >= MAX_ATTEMPTS:
        _report(instance, job, False, f"gave up after {failures} consecutive failed runs; fix the cause and launch "
                f"{name} again", attempt=failures)
        desired.set("stopped", reason="gave up", run_id=last.dagster_run.run_id)
        return None
    if failures:
        wait = BACKOFF_S * 2 ** (failures - 1)
        ended = last.end_time or last.update_timestamp.timestamp()
        if now - ended < wait:
            return None
    previous = last.dagster_run.run_id if last else "none"
    config = {"mode": "continuous", **durations_of(wanted),
              "max_files_per_trigger": int(wanted.get("max_files_per_trigger") or 0)}
    together = [job.name]
    if application:  # the application restarts as a whole, with those of its jobs that should run
        together = [n for n in application if n == job.name or DesiredState(instance, n).get().get("state") == "running"]
        savepoints = {n: DesiredState(instance, n).get().get("from_savepoint") for n in together}
        config.update(jobs=together, from_savepoints={n: sp for n, sp in savepoints.items() if sp})
        op = APP_OP
    else:
        config["from_savepoint"] = wanted.get("from_savepoint", "")
        op = job.name
    from_savepoint = any(DesiredState(instance, n).get().get("from_savepoint") for n in together)
    reason = "savepoint" if from_savepoint else "crashed" if failures else "ended"
    _report(instance, job, failures == 0, f"restarted {name} ({reason}; previous run {previous}, attempt {failures + 1})",
            attempt=failures + 1)
    for n in together:  # the savepoint is consumed by this restart
        state = DesiredState(instance, n)
        current = state.get()
        if current.get("from_savepoint"):
            state.set("running", **{k: v for k, v in current.items() if k not in ("state", "from_savepoint", "updated_ms")})
    return dg.RunRequest(
        run_key=f"{job.name}:{previous}:{int(now)}", job_name=name,
        run_config={"ops": {op: {"config": config}}},
        tags={"lakestream/restart-of": previous, "lakestream/restart-attempt": str(failures + 1),
              "lakestream/restart-reason": reason, JOBS_TAG: ",".join(together)},
    )


def _report(instance: dg.DagsterInstance, job: Job, passed: bool, text: str, attempt: int) -> None:
    instance.report_runless_asset_event(dg.AssetCheckEvaluation(
        asset_key=stream_key(job), check_name="stream_supervisor", passed=passed,
        severity=dg.AssetCheckSeverity.WARN if passed else dg.AssetCheckSeverity.ERROR,
        description=text, metadata={"attempt": attempt},
    ))
