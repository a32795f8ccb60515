"""The house's rules, read from the code itself (no Spark): the import direction between the top-level
packages, no import cycle between modules, and the protocols' boundaries (only ``streaming/spark`` reaches
into Spark's internals, only ``streaming/windows`` knows the window kinds, only ``streaming/io/sources``
the source kinds, only ``streaming/settings.py`` reads ``LAKESTREAM_*`` variables)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("streaming", "batch", "orchestration", "lakestream")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(module: str, path: Path) -> set[str]:
    """The project modules ``module`` imports, anywhere in it (lazy imports too), except those under
    ``if TYPE_CHECKING:`` (annotations only, never executed)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            target = ".".join(p for p in (base, node.module or "") if p)
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for name in candidates:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_streaming_imports_neither_batch_nor_orchestration_nor_the_front_end():
    upward = sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if m.startswith("streaming") for t in ts
                    if t.split(".")[0] != "streaming")
    assert upward == []
    assert sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if m.startswith("batch") for t in ts
                  if t.split(".")[0] in ("orchestration", "lakestream")) == []


def test_no_module_imports_itself_back_through_others():
    cycles = []
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def _code(path: Path) -> str:
    """The code of a file without its docstrings and comments."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body[0] = ast.Pass()
    return ast.unparse(tree)


def _offenders(pattern: str, allowed: str) -> list[str]:
    rule = re.compile(pattern)
    return sorted(str(p.relative_to(ROOT)) for m, p in MODULES.items()
                  if not str(p.relative_to(ROOT)).startswith(allowed) and rule.search(_code(p)))


def test_only_the_spark_folder_reaches_into_spark_internals():
    assert _offenders(r"\._(jvm|jsc|jdf|jsparkSession|jo|gateway|collect_as_arrow|parse_datatype_string)\b|"
                      r"_active_spark_context", "streaming/spark/") == []


def test_only_the_windows_package_knows_the_window_kinds():
    assert _offenders(r"isinstance\([^)]*\b(Tumbling|Sliding|Session)\b", "streaming/windows/") == []


def test_only_the_sources_package_knows_the_source_kinds():
    assert _offenders(r"\.is_table\b|format\s*==\s*'table'|\bis_table_offset\b", "streaming/io/sources/") == []


def test_only_the_settings_read_lakestream_variables():
    assert _offenders(r"environ(\.get)?[\[(]\s*'LAKESTREAM_|getenv\(\s*'LAKESTREAM_", "streaming/settings.py") == []


@pytest.mark.parametrize("package", ["streaming", "batch", "orchestration", "lakestream"])
def test_every_module_imports_on_its_own_in_a_fresh_interpreter(package):
    """A cycle of imports fails at import time in some order: import each module first, alone."""
    names = sorted(m for m in MODULES if m.split(".")[0] == package)
    code = ("import importlib, subprocess, sys\n"
            f"bad = [m for m in {names!r} if subprocess.run([sys.executable, '-c', 'import ' + m]).returncode]\n"
            "sys.exit(', '.join(bad) or 0)")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
