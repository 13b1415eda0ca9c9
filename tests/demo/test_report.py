"""The demo package: its figures are medians with their spread, and it sits above the library without cycles."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from globalloader.demo.report import spread
from globalloader.errors import ArgumentError

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "globalloader"


def test_spread_is_the_median_with_min_and_max():
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "runs": 3}
    assert spread([4.0, 1.0, 2.0, 10.0]) == {"median": 3.0, "min": 1.0, "max": 10.0, "runs": 4}
    with pytest.raises(ArgumentError, match="runs must be >= 1"):
        spread([])


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every module of the package -> the globalloader modules it imports (at any depth of its code)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("globalloader"):
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name.startswith("globalloader"))
        graph[_module_name(path)] = targets
    return {m: {t for t in targets if t in graph and t != m} for m, targets in graph.items()}


def test_only_the_command_line_imports_the_demo_and_the_demo_has_no_import_cycle():
    graph = _imports()
    demo = {m for m in graph if m == "globalloader.demo" or m.startswith("globalloader.demo.")}
    assert {"globalloader.demo.jobs", "globalloader.demo.report", "globalloader.demo.workload"} <= demo
    importers = {m for m, targets in graph.items() if targets & demo} - demo
    assert importers == {"globalloader.cli"}, f"library modules import the demo: {importers - {'globalloader.cli'}}"

    edges = {m: graph[m] & demo for m in demo}
    cycles = sorted(m for m in demo if any(_reaches(edges, t, m) for t in edges[m]))
    assert not cycles, f"import cycles through {cycles}"


def _reaches(edges: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(edges.get(node, ()))
    return False
