"""Where Megatron may be imported, read from the source (AST, no imports run; CPU only).

* Only ``megatron_mok/megatron/`` (the integration, launcher included) and
  ``megatron_mok/bench/`` import Megatron; every other module of the package runs without it.
  The entry point ``megatron_mok/pretrain_gpt.py`` is no exception: it calls the launcher in
  ``megatron_mok/megatron/pretrain.py`` and imports nothing of Megatron itself.
* The modules of ``megatron_mok/megatron/`` import each other one way: the graph of their
  imports (function-level imports included) has no cycle.
"""

from __future__ import annotations

import ast
import os
from typing import Dict, Iterator, List, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "megatron_mok")
MEGATRON_ALLOWED = ("megatron", "bench")
"""Subpackages of megatron_mok that may import Megatron."""


def _python_files(folder: str) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def _is_megatron(module: str) -> bool:
    return module == "megatron" or module.startswith("megatron.")


def _imported_modules(tree: ast.AST) -> Iterator[Tuple[int, str, int]]:
    """(line, module, relative level) of every import in ``tree``, at any depth, including
    ``importlib.import_module("...")`` and ``__import__("...")`` with a literal name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, 0
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, node.module, node.level
        elif isinstance(node, ast.ImportFrom):  # from . import a, b: the modules a and b
            for alias in node.names:
                yield node.lineno, alias.name, node.level
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__"):
                yield node.lineno, node.args[0].value, 0


def _parse(path: str) -> ast.AST:
    with open(path) as f:
        return ast.parse(f.read(), filename=path)


def test_only_the_integration_and_the_benchmarks_import_megatron():
    offenders = []
    checked = 0
    for path in _python_files(PACKAGE):
        relative = os.path.relpath(path, PACKAGE)
        if relative.split(os.sep)[0] in MEGATRON_ALLOWED:
            continue
        checked += 1
        for line, module, level in _imported_modules(_parse(path)):
            if level == 0 and _is_megatron(module):
                offenders.append(f"megatron_mok/{relative}:{line} imports {module}")
    assert checked > 10, f"scanned only {checked} modules; is {PACKAGE} the package?"
    assert not offenders, ("only megatron_mok/megatron/ and megatron_mok/bench/ may import Megatron:\n  "
                           + "\n  ".join(offenders))


def test_the_entry_point_only_calls_the_launcher():
    tree = _parse(os.path.join(PACKAGE, "pretrain_gpt.py"))
    imported = sorted({module for _, module, level in _imported_modules(tree) if level == 0})
    assert imported == ["megatron_mok.megatron.pretrain", "sys", "time"], imported


def _integration_graph() -> Dict[str, Set[str]]:
    """{module: modules of megatron_mok/megatron it imports}, by file stem (``__init__`` left
    out: it re-exports the modules)."""
    folder = os.path.join(PACKAGE, "megatron")
    names = {os.path.splitext(f)[0] for f in os.listdir(folder) if f.endswith(".py")} - {"__init__"}
    graph: Dict[str, Set[str]] = {}
    for name in sorted(names):
        edges = set()
        for _, module, level in _imported_modules(_parse(os.path.join(folder, name + ".py"))):
            if level == 1:
                target = module.split(".")[0]
            elif level == 0 and module.startswith("megatron_mok.megatron."):
                target = module.split(".")[2]
            else:
                continue
            if target in names and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def _find_cycle(graph: Dict[str, Set[str]]) -> List[str]:
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> List[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_the_integration_modules_import_each_other_one_way():
    graph = _integration_graph()
    assert {"arguments", "settings", "layer", "pretrain", "training_log"} <= set(graph)
    assert "settings" in graph["arguments"] and not graph["settings"]
    cycle = _find_cycle(graph)
    assert not cycle, "import cycle in megatron_mok/megatron/: " + " -> ".join(cycle)
