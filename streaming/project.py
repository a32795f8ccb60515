"""A lakestream project: the user's sources and jobs, found outside lakestream.

A project is a Python package (usually a folder made by ``lakestream new``) named in the settings
(``project:`` in ``lakestream.yaml``, or ``LAKESTREAM_PROJECT``)::

    my_project/
      __init__.py
      sources.py        # Source declarations (module-level Source objects)
      jobs/             # one module per job, each defining JOB (a WindowedJob or KeyedJob)
        __init__.py
        device_averages.py
      dbt/              # optional: a dbt project over the job tables (Dagster shows its models)

Without a project setting, the built-in example project runs: payments and logins with the fraud
jobs (``streaming/jobs/sources.py``, ``streaming/jobs/``), which is what ``make demo`` shows.

Loading checks that the declarations fit together and says what is wrong in one line: a module that
does not import, two jobs of one name, a job that reads a source the project does not declare, two
different sources of one name, a declared source that no job reads.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
import traceback
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Mapping

from .declaration import Job, KeyedJob, Source, Watermark, WindowedJob
from .errors import ConfigError, ProjectError, UnknownJobError
from .io.sources import kind_of

BUILTIN = "streaming.jobs"
_BUILTIN_SOURCES = "streaming.jobs.sources"


@dataclass(frozen=True)
class Project:
    name: str
    package: str  # the importable name of the package holding ``jobs``
    folder: Path | None  # the project's folder (None for an installed module without one)
    jobs: Mapping[str, Job]
    sources: Mapping[str, Source]

    @property
    def builtin(self) -> bool:
        return self.package == BUILTIN

    @property
    def dbt_dir(self) -> Path | None:
        """The project's dbt project, if it has one (the built-in example's is the repository's ``dbt/``)."""
        if self.builtin:
            folder = Path(__file__).resolve().parents[1] / "dbt"
        elif self.folder is None:
            return None
        else:
            folder = self.folder / "dbt"
        return folder if (folder / "dbt_project.yml").exists() else None


def registry(settings=None) -> dict[str, Job]:
    """The jobs of the project of ``settings`` (default: the environment's settings), by name, each with the
    deployment's overrides of ``settings`` applied (``jobs.<name>``: watermark, lateness, dedup TTL).
    Resolve a job once (a command, a Dagster definitions load) and pass the object on."""
    from dataclasses import replace

    project = current(settings)
    jobs = dict(project.jobs)
    if settings is None:
        return jobs
    unknown = sorted(set(settings.jobs) - set(jobs))
    if unknown:  # a misspelled job's settings would apply to nothing, silently
        where = f"{settings.config_file}: " if settings.config_file else ""
        what = f"{unknown[0]} is not a job" if len(unknown) == 1 else f"{', '.join(unknown)} are not jobs"
        raise ConfigError(f"{where}jobs: {what} of project {project.name}; its jobs are {', '.join(sorted(jobs))} "
                          "(fix the name, or remove the block)")

    def given(value, default):  # an override of zero is an override: never `value or default`
        return default if value is None else value

    resolved = {}
    for name, job in jobs.items():
        overrides = settings.job(name)
        watermark = Watermark(
            out_of_orderness=given(overrides.out_of_orderness, job.watermark.out_of_orderness),
            allowed_lateness=given(overrides.allowed_lateness, job.watermark.allowed_lateness),
        )
        resolved[name] = replace(job, watermark=watermark, dedup_ttl=given(overrides.dedup_ttl, job.dedup_ttl))
    return resolved


def get_job(name: str, settings=None) -> Job:
    """The job ``name`` of the project of ``settings``, with the deployment's overrides (see :func:`registry`)."""
    jobs = registry(settings)
    if name not in jobs:
        raise UnknownJobError(f"unknown job {name!r}; known jobs: {', '.join(jobs)} (see `lakestream jobs`)")
    return jobs[name]


def current(settings=None) -> Project:
    """The project of ``settings`` (default: the settings of the environment)."""
    if settings is None:
        from .settings import Settings

        settings = Settings.load()
    return load(settings.project)


@lru_cache(maxsize=8)
def load(spec: str | None) -> Project:
    """The project named by ``spec``: a folder, a module name, or None for the built-in example."""
    if spec is None:
        return _collect("lakestream example (payments, logins)", BUILTIN, None, _import(BUILTIN, "the built-in project"),
                        sources_module=_BUILTIN_SOURCES)
    folder = Path(spec)
    if folder.is_absolute():
        name = folder.name
        if not name.isidentifier():
            raise ProjectError(f"project folder {folder}: its name must be a Python identifier (it is imported as a "
                               f"package), e.g. {name.replace('-', '_')}")
        clash = sys.modules.get(name)
        if clash is not None and not _inside(clash, folder):
            raise ProjectError(f"project folder {folder}: a module named {name!r} is already imported from "
                               f"{getattr(clash, '__file__', None) or 'elsewhere'}; rename the project folder")
        parent = str(folder.parent)
        if parent not in sys.path:
            sys.path.insert(0, parent)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (parent, os.environ.get("PYTHONPATH")) if p)
        package = _import(name, f"project {folder}")
        project = _collect(name, name, folder, package, sources_module=f"{name}.sources")
    else:
        package = _import(spec, f"project {spec}")
        where = Path(package.__file__).parent if getattr(package, "__file__", None) else None
        project = _collect(spec.rsplit(".", 1)[-1], spec, where, package, sources_module=f"{spec}.sources")
    # The project's code travels with the tasks (Spark pickles its transforms and functions by value), so
    # executors on a cluster need no copy of the project installed.
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[project.package.split(".")[0]])
    return project


def _inside(module: ModuleType, folder: Path) -> bool:
    paths = [getattr(module, "__file__", None) or "", *list(getattr(module, "__path__", []) or [])]
    return any(p and Path(p).resolve().is_relative_to(folder.resolve()) for p in paths)


def _import(module: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ProjectError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of the user's code, said in one line
        raise ProjectError(f"{what} does not import: {module}: {_where(exc)}") from None


def _where(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename]
    place = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {text}{place}"


def _job_modules(package: ModuleType, name: str) -> list[ModuleType]:
    if package.__name__ == BUILTIN:
        holder = package
    else:
        try:
            holder = importlib.import_module(f"{name}.jobs")
        except ModuleNotFoundError as exc:
            if exc.name != f"{name}.jobs":
                raise ProjectError(f"project {name} does not import: {name}.jobs: {_where(exc)}") from None
            return [package]  # a project may declare JOB / JOBS in its package itself
        except Exception as exc:  # noqa: BLE001
            raise ProjectError(f"project {name} does not import: {name}.jobs: {_where(exc)}") from None
    modules = [holder]
    for info in sorted(pkgutil.iter_modules(getattr(holder, "__path__", [])), key=lambda m: m.name):
        modules.append(_import(f"{holder.__name__}.{info.name}", f"project {name}"))
    return modules


def _jobs_of(module: ModuleType) -> list[Job]:
    found = []
    job = getattr(module, "JOB", None)
    if job is not None:
        found.append(job)
    found += list(getattr(module, "JOBS", ()) or ())
    for job in found:
        if not isinstance(job, (WindowedJob, KeyedJob)):
            raise ProjectError(f"{module.__name__}: JOB must be a WindowedJob or KeyedJob, got {type(job).__name__}")
    return found


def _declared_sources(module_name: str, project: str) -> list[tuple[Source, str]] | None:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return None  # no sources module: the sources are the ones its jobs read
        raise ProjectError(f"project {project} does not import: {module_name}: {_where(exc)}") from None
    except Exception as exc:  # noqa: BLE001
        raise ProjectError(f"project {project} does not import: {module_name}: {_where(exc)}") from None
    return [(value, module_name) for value in vars(module).values() if isinstance(value, Source)]


def _collect(title: str, package_name: str, folder: Path | None, package: ModuleType, *, sources_module: str) -> Project:
    jobs: dict[str, Job] = {}
    origin: dict[str, str] = {}
    for module in _job_modules(package, package_name):
        for job in _jobs_of(module):
            if job.name in jobs and jobs[job.name] is not job:
                raise ProjectError(f"project {title}: two jobs are named {job.name!r} ({origin[job.name]} and "
                                   f"{module.__name__}); rename one")
            jobs[job.name] = job
            origin[job.name] = module.__name__
    if not jobs:
        raise ProjectError(f"project {title} declares no job: add a module to {package_name}.jobs defining "
                           "JOB = WindowedJob(...) (see `lakestream new`)")
    sources: dict[str, Source] = {}
    declared = _declared_sources(sources_module, title)
    for source, where in declared or []:
        if source.name in sources and sources[source.name] != source:
            raise ProjectError(f"project {title}: two different sources are named {source.name!r} in {where}; rename one")
        sources[source.name] = source
    for name, job in jobs.items():
        for source in job.sources:
            known = sources.get(source.name)
            if declared is not None and known is None:
                raise ProjectError(f"job {name} ({origin[name]}) reads source {source.name!r}, which {sources_module} "
                                   f"does not declare (it declares {', '.join(sorted(sources)) or 'none'})")
            if known is not None and known != source:
                raise ProjectError(f"job {name} ({origin[name]}) reads a source {source.name!r} that differs from the "
                                   f"one declared in {sources_module}; import the declared one")
            sources[source.name] = source
    writers = {job.sink.name: job for job in jobs.values()}
    for source in sources.values():
        writer = writers.get(kind_of(source).upstream_table(source))
        if writer is not None and writer.upserts:
            raise ProjectError(f"source {source.name} reads {source.location}, which job {writer.name} upserts (allowed "
                               f"lateness or sessions): a table source must be append-only; read {writer.name}'s late "
                               "table or set its allowed lateness to 0")
        if writer is not None and any(s.name == source.name for s in writer.sources):
            raise ProjectError(f"job {writer.name} reads its own output {source.location} (source {source.name})")
    unread = sorted(set(sources) - {s.name for j in jobs.values() for s in j.sources})
    if unread:
        raise ProjectError(f"project {title}: source(s) {', '.join(unread)} declared in {sources_module} but read by "
                           "no job; add a job that reads them or remove the declaration")
    return Project(name=title, package=package_name, folder=folder, jobs=dict(sorted(jobs.items())), sources=sources)
