"""The jobs of the built-in example project (payments and logins), and the job registry.

The registry holds the jobs of the configured project (``streaming.project``): a user's project
when the settings name one, else this package, where every module that defines ``JOB`` is a job.
A new job is a new module in the project's ``jobs`` folder; nothing else needs editing (the CLI and
Dagster read the registry).
"""

from __future__ import annotations

from dataclasses import replace

from ..declaration import Job, Watermark
from ..errors import UnknownJobError
from ..settings import Settings


def registry(settings: Settings | None = None) -> dict[str, Job]:
    """The jobs of the project of ``settings`` (default: the environment's settings), by name."""
    from ..project import current

    return dict(current(settings).jobs)


def get_job(name: str, settings: Settings | None = None) -> Job:
    """The declared job ``name`` with the deployment's overrides from ``settings`` applied."""
    jobs = registry(settings)
    if name not in jobs:
        raise UnknownJobError(f"unknown job {name!r}; known jobs: {', '.join(jobs)} (see `lakestream jobs`)")
    job = jobs[name]
    if settings is None:
        return job
    overrides = settings.job(name)
    def given(value, default):  # an override of zero is an override: never `value or default`
        return default if value is None else value

    watermark = Watermark(
        out_of_orderness=given(overrides.out_of_orderness, job.watermark.out_of_orderness),
        allowed_lateness=given(overrides.allowed_lateness, job.watermark.allowed_lateness),
    )
    return replace(job, watermark=watermark, dedup_ttl=given(overrides.dedup_ttl, job.dedup_ttl))
