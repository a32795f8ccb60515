"""The job registry: every module in this package that defines ``JOB`` is a job.

A new job is a new module here; nothing else needs editing (the CLI and Dagster read the registry).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import replace
from functools import cache

from ..declaration import Job, Watermark
from ..errors import UnknownJobError
from ..settings import Settings


@cache
def registry() -> dict[str, Job]:
    jobs: dict[str, Job] = {}
    for module in pkgutil.iter_modules(__path__):
        job = getattr(importlib.import_module(f"{__name__}.{module.name}"), "JOB", None)
        if job is not None:
            jobs[job.name] = job
    return dict(sorted(jobs.items()))


def get_job(name: str, settings: Settings | None = None) -> Job:
    """The declared job ``name`` with the deployment's overrides from ``settings`` applied."""
    jobs = registry()
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
