"""The import contract: layers import downward only (pyproject's import-linter contracts) and no two files import
each other, directly or through others.  A function-level import counts like a top-level one: it is still a
dependency."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("adapt", "operators", "parallel_planner", "validators", "reports")


def _cycles() -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm over the import graph)."""
    graph = grimp.build_graph(*PACKAGES)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    counter = 0
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return groups


def test_no_import_cycles_between_files():
    assert _cycles() == []


def test_layers_import_downward_only():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if lint is None:
        pytest.skip("import-linter is not installed")
    proc = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:]


def test_no_script_directory_module_shadows_an_installed_package():
    """``python benchmarks/x.py`` puts ``benchmarks/`` first on the import path, so a file there named like an
    installed top-level package replaces it for every library in that process (transformers 5.25 imports the
    ``kernels`` package, which ``benchmarks/kernels.py`` once shadowed)."""
    import importlib.metadata

    installed = set(importlib.metadata.packages_distributions()) | set(sys.stdlib_module_names)
    for directory in ("benchmarks", "examples"):
        stems = {p.stem for p in (ROOT / directory).glob("*.py")} - {"__init__"}
        assert not stems & installed, f"{directory}/ shadows {sorted(stems & installed)}"
