"""Import cycles the layout was cut free of stay cut.

The graph is read from the sources (every `import` and `from ... import`,
lazy ones inside functions included), so a cycle hidden behind a function-
level import counts too: it still means two modules that cannot be read,
tested or moved apart.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("models", "kvcache", "transfer", "runtime", "engine", "cluster", "benchmarks")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    paths = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module == goal:
            return True
        if module not in seen:
            seen.add(module)
            todo.extend(graph.get(module, ()))
    return False


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("cluster.config.schema", "cluster.config.trtllm"),
        ("kvcache.sizing", "kvcache.tensors"),
        ("transfer.factory", "transfer.python.transceiver"),
        ("transfer.python.transceiver", "transfer.python.puller"),
    ],
)
def test_no_cycle_between(first: str, second: str) -> None:
    graph = import_graph()
    assert first in graph and second in graph
    assert not (reaches(graph, first, second) and reaches(graph, second, first))
