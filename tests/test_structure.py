"""Structural rules of the package layout (docs/design.md, "Invariants" and "Conventions"): the
dependency direction train -> infer, no import cycles, and helpers that ``train/`` uses from
``infer/`` importable without the engine.

Imports are read from the source with ``ast`` (module level and inside functions alike), so a
lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("infer", "train")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (relative imports resolved)."""
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            for name in _imported(node, mod, is_pkg):
                while name and name not in files:  # "infer.models.llama.Llama" -> the module
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    deps.add(name)
        graph[mod] = deps
    return graph


def _imported(node: ast.AST, mod: str, is_pkg: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([base] if base else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def without_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package ``__init__`` that re-exports its modules is not a dependency of theirs."""
    inits = {m for m in graph if (ROOT / m.replace(".", "/") / "__init__.py").is_file()}
    return {m: {d for d in deps if d not in inits} for m, deps in graph.items()}


def test_infer_never_imports_train():
    graph = import_graph()
    wrong = sorted(f"{m} -> {d}" for m, deps in graph.items() if m.startswith("infer")
                   for d in deps if d.startswith("train"))
    assert wrong == []


def test_no_import_cycles():
    assert cycles(without_package_inits(import_graph())) == []


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_light_helpers_import_without_torch():
    """What ``train/`` (and the entry points' config) use from ``infer/`` loads without torch
    or the engine: ``import infer.foundation.validation`` in a fresh process stays cheap."""
    code = ("import sys, infer.foundation.validation, infer.foundation.atomic, "
            "infer.foundation.registry, infer.config_docs, "
            "infer.data_sources, infer.config, infer.sampling_params; "
            "print(sorted(m for m in ('torch', 'infer.engine', 'datasets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_every_source_folder_is_a_package():
    """setuptools' find_packages (pyproject) installs only folders with an ``__init__.py``."""
    folders = {p.parent for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    assert sorted(str(f.relative_to(ROOT)) for f in folders
                  if not (f / "__init__.py").is_file()) == []
