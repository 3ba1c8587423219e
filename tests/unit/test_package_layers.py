"""Package layering.

`models` builds on `kvcache` (specs, cache views), never the reverse. Inside
`cluster/` and `transfer/` each sub-room imports only the rooms below it:
the two transceivers never import each other, and a room reaches the top of
its package only for what the tree names as shared there.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Room -> the rooms of its own package it may import (`transfer.top`: the top
# of transfer/; a top-level cluster module by name). Lazy imports inside
# functions count; `cluster` may import `transfer` anywhere, as it builds on it.
ALLOWED_ROOMS: dict[str, set[str]] = {
    "cluster.config": set(),
    "cluster.launch": {"cluster.config"},
    "cluster.routing": {"cluster.metrics"},
    "cluster.api": {"cluster.config", "cluster.routing", "cluster.metrics"},
    "cluster.bench": set(),
    "transfer.nixl": {"transfer.top"},
    "transfer.python": {"transfer.top"},
}
# The top of transfer/ holds the interface and what both transceivers share;
# only the factory builds one, so only it imports a transceiver's room.
TRANSFER_TOP_BUILDERS = {"factory"}


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def _imported_packages(path: Path) -> set[str]:
    return {name.split(".")[0] for name in _imported_modules(path)}


def _room_of(module: str) -> str | None:
    """`cluster.api` for `cluster.api.server`; `transfer.top` for a top-level
    transfer module; `cluster.metrics` for a top-level cluster module."""
    parts = module.split(".")
    if parts[0] not in ("cluster", "transfer") or len(parts) < 2:
        return None
    if (ROOT / parts[0] / parts[1]).is_dir():
        return f"{parts[0]}.{parts[1]}"
    return "transfer.top" if parts[0] == "transfer" else f"cluster.{parts[1]}"


def _room_imports(room: str) -> dict[str, set[str]]:
    package, name = room.split(".")
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package / name).glob("*.py")):
        rooms = {_room_of(module) for module in _imported_modules(path)}
        found[path.name] = {
            r for r in rooms if r is not None and r != room and r.startswith(f"{package}.")
        }
    return found


def test_kvcache_imports_nothing_from_models() -> None:
    offenders = sorted(
        path.name
        for path in (ROOT / "kvcache").glob("*.py")
        if "models" in _imported_packages(path)
    )
    assert offenders == [], f"kvcache modules that import models: {offenders}"


def test_every_sub_room_of_cluster_and_transfer_has_a_rule() -> None:
    rooms = {
        f"{package}.{path.name}"
        for package in ("cluster", "transfer")
        for path in (ROOT / package).iterdir()
        if (path / "__init__.py").is_file()
    }
    assert rooms == set(ALLOWED_ROOMS)


def test_sub_rooms_import_only_the_rooms_below_them() -> None:
    offenders = {
        f"{room}/{file}": sorted(imported - allowed)
        for room, allowed in ALLOWED_ROOMS.items()
        for file, imported in _room_imports(room).items()
        if imported - allowed
    }
    assert offenders == {}, f"imports that run up or across rooms: {offenders}"


def test_only_the_factory_at_the_top_of_transfer_imports_a_transceiver() -> None:
    offenders = sorted(
        path.name
        for path in (ROOT / "transfer").glob("*.py")
        if path.stem not in TRANSFER_TOP_BUILDERS
        and {_room_of(m) for m in _imported_modules(path)} - {"transfer.top", None}
    )
    assert offenders == [], f"shared transfer modules that import a room: {offenders}"
