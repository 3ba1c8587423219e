"""Package layering: `models` builds on `kvcache` (specs, cache views), never the reverse."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imported_packages(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
    return names


def test_kvcache_imports_nothing_from_models() -> None:
    offenders = sorted(
        path.name
        for path in (ROOT / "kvcache").glob("*.py")
        if "models" in _imported_packages(path)
    )
    assert offenders == [], f"kvcache modules that import models: {offenders}"
