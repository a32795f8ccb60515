"""``lakestream new PROJECT_DIR``: a runnable project of your own (like ``dagster project scaffold``).

It holds one source (CSV or JSON lines), one windowed job, a settings file, a sample-data generator
and a test that runs the job with the harness against a plain-Python oracle.
"""

from __future__ import annotations

from pathlib import Path

from streaming.errors import ConfigError

SOURCES = '''"""{name}'s sources: what lands in the landing zone, in which format, with which rules.

Field types: string (pattern=...), int, long, double, decimal(p,s), boolean, date, timestamp,
enum (choices=...), ip; required=False lets a field be missing. A record that breaks a rule goes
to lake.quarantine.<source> with the reason.
"""

from streaming.declaration import Field, Source

EVENTS = Source(
    name="{source}",
    description="Events of users: one record per event.",
    format="{format}",{csv_options}
    event_time="event_time",
    dedup_key="event_id",
    fields=(
        Field("event_id", "string", pattern=r"^e-[0-9]+$"),
        Field("event_time", "timestamp"),
        Field("user_id", "string", pattern=r"^u-[0-9]+$"),
        Field("kind", "enum", choices=("view", "click", "buy")),
        Field("value", "double"),
        Field("note", "string", required=False),
    ),
)
'''

JOB = '''"""{job}: per user, 1-minute tumbling windows of events: how many, and the sum of their values.

Late events (behind the watermark when they arrive) go to lake.{namespace}.{job}_late; invalid
records to lake.quarantine.{source}.
"""

from datetime import timedelta

from pyspark.sql import DataFrame

from streaming.declaration import Agg, Table, Watermark, WindowedJob
from streaming.windows import Tumbling

from ..sources import EVENTS


def measures(events: DataFrame) -> DataFrame:
    """The columns the aggregates read, plus the key, the event time and the dedup key."""
    return events.select("user_id", "event_time", "event_id", "value")


JOB = WindowedJob(
    name="{job}",
    description="Per user and minute: events and the sum of their values.",
    sources=(EVENTS,),
    keys=("user_id",),
    window=Tumbling(size=timedelta(minutes=1)),
    watermark=Watermark(out_of_orderness=timedelta(seconds=10)),
    transform=measures,
    aggregates=(Agg.count("events"), Agg.sum("value", "value_sum")),
    sink=Table("lake.{namespace}.{job}"),
)
'''

GENERATE = '''"""Sample data for {name}: one file of events per minute of arrival, a few late, repeated or bad.

    lakestream --config lakestream.yaml generate       (calls generate() below)
"""

from __future__ import annotations

import json
import random
from datetime import datetime, timedelta, timezone
from pathlib import Path

START = datetime(2026, 11, 20, 12, 0, tzinfo=timezone.utc)
COLUMNS = ("event_id", "event_time", "user_id", "kind", "value", "note")


def record_text(record: dict) -> str:
    {record_text}


def generate(landing: str | Path, minutes: int = 10, users: int = 5, seed: int = 1) -> str:
    """Write the sample files into ``landing/{source}`` (files already there are kept); say what was written."""
    rng = random.Random(seed)
    folder = Path(landing) / "{source}"
    folder.mkdir(parents=True, exist_ok=True)
    written = 0
    for minute in range(minutes):
        lines = []
        for k in range(12):
            at = START + timedelta(minutes=minute, seconds=5 * k, milliseconds=rng.randrange(1000))
            if minute > 2 and rng.random() < 0.05:
                at -= timedelta(minutes=2)  # arrives two minutes late: the late side output
            record = {{"event_id": f"e-{{minute * 100 + k}}", "event_time": at.isoformat().replace("+00:00", "Z"),
                      "user_id": f"u-{{rng.randrange(users)}}", "kind": rng.choice(["view", "click", "buy"]),
                      "value": round(rng.uniform(0, 100), 2), "note": ""}}
            lines.append(record_text(record))
        if minute == 4:
            lines.append(record_text({{"event_id": "e-bad", "event_time": "yesterday", "user_id": "u-1", "kind": "view",
                                      "value": 1.0, "note": ""}}))  # quarantined: not a timestamp
        path = folder / f"{{(START + timedelta(minutes=minute)).strftime('%Y%m%dT%H%M')}}.{ext}"
        if not path.exists():
            tmp = path.with_name("." + path.name)
            tmp.write_text("\\n".join([{header}*lines]) + "\\n")
            tmp.rename(path)
            written += 1
    return f"{{written}} file(s) of sample events in {{folder}}"
'''

CSV_RECORD = 'return ",".join(str(record[c]) for c in COLUMNS)'
JSON_RECORD = 'return json.dumps({k: v for k, v in record.items() if v != ""})'

TEST = '''"""{job} with lakestream's test harness: as a stream (batch by batch) and as its bounded twin,
against a plain-Python oracle over the same records."""

import importlib
from collections import Counter
from datetime import datetime
from pathlib import Path

from streaming.project import load
from lakestream.testing import JobHarness

PROJECT = load(str(Path(__file__).resolve().parents[1]))
JOB = PROJECT.jobs["{job}"]
record_text = importlib.import_module(f"{{PROJECT.package}}.generate").record_text


def event(event_id, at, user, value):
    return record_text({{"event_id": event_id, "event_time": at, "user_id": user, "kind": "buy", "value": value,
                        "note": ""}})


def minute_of(at: str) -> datetime:
    return datetime.fromisoformat(at.replace("Z", "+00:00")).replace(second=0, microsecond=0, tzinfo=None)


def test_{job}_stream_and_twin(tmp_path):
    batches = [
        [event("e-1", "2026-11-20T12:00:05Z", "u-1", 10.0), event("e-2", "2026-11-20T12:00:30Z", "u-1", 5.5),
         event("e-3", "2026-11-20T12:00:40Z", "u-2", 1.0)],
        [event("e-4", "2026-11-20T12:01:20Z", "u-1", 2.0), event("e-2", "2026-11-20T12:00:30Z", "u-1", 5.5),  # repeated
         event("e-5", "2026-11-20T12:02:30Z", "u-2", 4.0)],
        [event("e-6", "2026-11-20T12:00:50Z", "u-1", 7.0),  # behind the watermark (12:02:20): late
         event("e-7", "not a time", "u-1", 1.0)],             # invalid: quarantined
    ]
    harness = JobHarness(JOB, tmp_path)
    out = harness.stream(batches)

    # oracle: windows that closed by the end (watermark = newest event time - 10 s), late and bad records
    on_time = {{"e-1": ("u-1", "2026-11-20T12:00:05Z", 10.0), "e-2": ("u-1", "2026-11-20T12:00:30Z", 5.5),
               "e-3": ("u-2", "2026-11-20T12:00:40Z", 1.0), "e-4": ("u-1", "2026-11-20T12:01:20Z", 2.0),
               "e-5": ("u-2", "2026-11-20T12:02:30Z", 4.0)}}
    closed = Counter()
    sums = Counter()
    for user, at, value in on_time.values():
        if minute_of(at) < datetime(2026, 11, 20, 12, 2):  # windows ending by the watermark 12:02:20
            closed[(user, minute_of(at))] += 1
            sums[(user, minute_of(at))] += value
    got = {{(r.user_id, r.window_start.to_pydatetime()): (r.events, r.value_sum) for r in out.main.itertuples()}}
    assert got == {{k: (closed[k], sums[k]) for k in closed}}
    assert list(out.late["event_id"]) == ["e-6"]
    assert len(out.quarantine) == 1 and "event_time" in out.quarantine.loc[0, "reason"]

    # the bounded twin: every window of every valid record (nothing is late in a bounded run)
    twin = harness.bounded()
    everything = {{**on_time, "e-6": ("u-1", "2026-11-20T12:00:50Z", 7.0)}}
    counts = Counter((user, minute_of(at)) for user, at, _ in everything.values())
    assert {{(r.user_id, r.window_start.to_pydatetime()): r.events for r in twin.main.itertuples()}} == dict(counts)
    # and reconciliation explains every difference between the stream and the twin (here: the late event)
    assert harness.reconcile().unexplained == 0
'''

SETTINGS = '''# lakestream settings of {name} (relative paths are relative to this file)
home: .lake                 # the lake home: tables, checkpoints, landing (LAKESTREAM_HOME wins when set)
project: .                  # this folder: its sources.py and jobs/
# landing: /data/landing    # where the sources' folders are (default: $LAKESTREAM_HOME/landing)
# format: delta             # table format (default: iceberg)
jobs:
  {job}: {{}}               # per job, e.g. out_of_orderness: 10s, or trigger_interval: 5s (default: a batch
                            # as soon as input arrives; an interval trades latency for fewer, larger batches)
'''

README = '''# {name}

A lakestream project: one source (`{source}`, {format_text} files in `<landing>/{source}/`) and one
windowed job (`{job}`: per user, 1-minute windows).

```bash
lakestream --config lakestream.yaml generate && lakestream --config lakestream.yaml run {job} --available-now
python -m pytest tests
```

(`lakestream` is the command of the virtualenv lakestream is installed in: activate it, or call it by its path,
e.g. `~/lakestream/.venv/bin/lakestream`.)

The first command writes sample files into the landing folder and streams them into
`lake.{namespace}.{job}` (Iceberg tables under `./.lake`, late events in `{job}_late`, bad records in
`lake.quarantine.{source}`); the second runs the job's test with lakestream's harness (`lakestream.testing`).
Then, with the same `--config`: `backfill {job} --start 2026-11-20 --end 2026-11-21`,
`reconcile ...`, `savepoint create {job}`, `checkpoint inspect {job}`. The Dagster UI shows the project
(with its history kept under `./.lake/dagster`):

```bash
export LAKESTREAM_CONFIG=$PWD/lakestream.yaml DAGSTER_HOME=$PWD/.lake/dagster && mkdir -p $DAGSTER_HOME
dagster dev -f definitions.py
```

Layout:

- `sources.py` — the source declarations (fields and rules, format, event time, dedup key);
- `jobs/` — one module per job, each defining `JOB` (a `WindowedJob` or a `KeyedJob`);
- `definitions.py` — the project's Dagster definitions (assets, checks, sensors, schedules, lineage);
- `generate.py` — sample data (`lakestream generate` calls its `generate(landing)`): an example;
- `tests/` — the job's test;
- `lakestream.yaml` — settings (`project: .` names this folder, `home: .lake` the lake home beside it: relative
  paths in it are relative to this file, wherever you run lakestream from).

## Making it your own

Everything here but `lakestream.yaml` and `definitions.py` is an example to replace:

1. **Your source**: in `sources.py`, rename `EVENTS` and give it your fields (their names, types and rules),
   its `event_time` and `dedup_key` fields, its format and folder. A CSV file may start with a header line:
   columns are then matched to fields by name, in any order.
2. **Your job**: replace `jobs/{job}.py` (or add modules next to it; each defines `JOB`). It imports the
   source from `..sources`: import yours. Keys, window, watermark, transform and aggregates are declared
   there (`Agg.count/sum/min/max/avg/count_distinct/first/last/percentile`).
3. **Its test**: `tests/test_{job}.py` streams a few records through the job with `JobHarness` and checks
   the result against plain Python: write yours for your job (the records are text lines of your format).
4. **The sample data**: delete `generate.py` once real files land in `<landing>/<your source>/`
   (`lakestream generate` then has nothing to write for this project).
5. **Settings**: in `lakestream.yaml`, name your job in the `jobs:` block if it needs settings of its own
   (a job name the project does not have is refused).

`lakestream new NAME --bare` writes the same layout with one source and one job skeleton, without sample
data.
'''

BARE_SOURCES = '''"""{name}'s sources: what lands in the landing zone, in which format, with which rules."""

from streaming.declaration import Field, Source

EVENTS = Source(
    name="{source}",
    format="{format}",{csv_options}
    event_time="event_time",  # a timestamp field: when the event happened
    dedup_key="event_id",     # a field that identifies an event (a re-delivery counts once)
    fields=(
        Field("event_id", "string"),
        Field("event_time", "timestamp"),
        Field("key", "string"),
        # your fields, e.g. Field("amount", "decimal(18,2)"), Field("site", "enum", choices=("north", "south"))
    ),
)
'''

BARE_JOB = '''"""{job}: per key, 1-minute windows: how many events."""

from datetime import timedelta

from streaming.declaration import Agg, Table, Watermark, WindowedJob
from streaming.windows import Tumbling

from ..sources import EVENTS

JOB = WindowedJob(
    name="{job}",
    sources=(EVENTS,),
    keys=("key",),
    window=Tumbling(size=timedelta(minutes=1)),
    watermark=Watermark(out_of_orderness=timedelta(seconds=10)),
    transform=lambda events: events,  # the columns the aggregates read (keep the key, event time and dedup key)
    aggregates=(Agg.count("events"),),
    sink=Table("lake.{namespace}.{job}"),
)
'''

BARE_TEST = '''"""{job} with lakestream's test harness, against plain Python."""

from pathlib import Path

from streaming.project import load
from lakestream.testing import JobHarness

JOB = load(str(Path(__file__).resolve().parents[1])).jobs["{job}"]


def test_{job}(tmp_path):
    lines = [{lines}]
    out = JobHarness(JOB, tmp_path).stream([lines[:2], lines[2:]])
    # the window 12:00-12:01 closes once the watermark (newest event - 10 s) passes 12:01
    assert {{(r.key, r.events) for r in out.main.itertuples()}} == {{("k-1", 2)}}
'''

BARE_README = '''# {name}

A lakestream project skeleton: one source (`{source}`, {format_text} files in `<landing>/{source}/`) in
`sources.py`, one windowed job in `jobs/{job}.py`, its test in `tests/`, settings in `lakestream.yaml`,
Dagster definitions in `definitions.py`. Give the source your fields, the job your keys and aggregates,
and the test your records; then:

```bash
python -m pytest tests
lakestream --config lakestream.yaml run {job} --available-now
```
'''

DEFINITIONS = '''"""{name}'s Dagster definitions: this project's jobs as assets (streams, tables, checks, sensors, schedules,
lineage), with this project's settings (its lakestream.yaml; no LAKESTREAM_* variable is needed).

    dagster dev -f definitions.py      (or a code location of a workspace: python_file: <folder>/definitions.py)
"""

from pathlib import Path

from orchestration.definitions import definitions_for

defs = definitions_for(config=Path(__file__).with_name("lakestream.yaml"))
'''


# pyspark 3.5 calls pandas and distutils APIs that announce their deprecation (a hundred lines per test run):
# they are not the project's warnings, and hid its own
PYTEST_INI = """[pytest]
# pyspark 3.5 calls pandas and distutils APIs that announce their own deprecation: not this project's warnings
filterwarnings =
    ignore::DeprecationWarning:pyspark
"""


def scaffold(folder: str | Path, fmt: str = "csv", bare: bool = False) -> list[Path]:
    """Write a new project into ``folder`` (which must not exist or be empty); return the files written.
    ``bare``: one source and one job skeleton, without sample data."""
    root = Path(folder).expanduser().resolve()
    name = root.name
    if not name.isidentifier():
        raise ConfigError(f"project name {name!r} must be a Python identifier (it is imported as a package), "
                          f"e.g. {name.replace('-', '_')}")
    if fmt not in ("csv", "json"):
        raise ConfigError(f"--format must be csv or json, got {fmt!r}")
    if root.exists() and any(root.iterdir()):
        raise ConfigError(f"{root} exists and is not empty; choose a new folder")
    job, source, namespace = ("events_per_key" if bare else "events_per_user"), "events", name.lower()
    csv = fmt == "csv"
    values = {
        "name": name, "job": job, "source": source, "namespace": namespace, "format": fmt,
        "csv_options": '\n    header=True,\n    delimiter=",",' if csv else "",
        "record_text": CSV_RECORD if csv else JSON_RECORD,
        "ext": "csv" if csv else "jsonl", "header": '",".join(COLUMNS), ' if csv else "",
        "format_text": "CSV (with a header line)" if csv else "JSON lines",
        "lines": ", ".join(repr(line) for line in _bare_lines(csv)),
    }
    files = {
        "__init__.py": f'"""{name}: a lakestream project (see README.md)."""\n',
        "jobs/__init__.py": "",
        "tests/__init__.py": "",
        "definitions.py": DEFINITIONS.format(**values),
        "lakestream.yaml": SETTINGS.format(**values),
        ".gitignore": ".lake/\n__pycache__/\n",
        "pytest.ini": PYTEST_INI,
    }
    if bare:
        files.update({"sources.py": BARE_SOURCES.format(**values), f"jobs/{job}.py": BARE_JOB.format(**values),
                      f"tests/test_{job}.py": BARE_TEST.format(**values), "README.md": BARE_README.format(**values)})
    else:
        files.update({"sources.py": SOURCES.format(**values), f"jobs/{job}.py": JOB.format(**values),
                      "generate.py": GENERATE.format(**values), f"tests/test_{job}.py": TEST.format(**values),
                      "README.md": README.format(**values)})
    written = []
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def _bare_lines(csv: bool) -> list[str]:
    """The bare test's records: two events of k-1 in the first minute, then one that moves the watermark."""
    records = [("e-1", "2026-11-20T12:00:05Z", "k-1"), ("e-2", "2026-11-20T12:00:40Z", "k-1"),
               ("e-3", "2026-11-20T12:01:30Z", "k-2")]
    if csv:
        return [",".join(r) for r in records]
    return ['{"event_id": "%s", "event_time": "%s", "key": "%s"}' % r for r in records]
