"""The `auto` rules: which manager, transceiver and reuse setting a cluster runs.

Each rule is one function, called once at startup by the launcher before any
worker is built; each logs its decision. Model preferences arrive as plain
strings (callers take them from `models.registry.model_preferences(arch)`), so
this module never imports `models`.
"""

from __future__ import annotations

import logging

from kvcache.errors import LayoutConflictError, ResolutionError
from kvcache.snapshots import SnapshotPolicy

logger = logging.getLogger(__name__)

AUTO = "auto"
V1, V2 = "v1", "v2"
MANAGER_CHOICES = (AUTO, V1, V2)
PYTHON, NIXL = "python", "nixl"
TRANSCEIVER_CHOICES = (AUTO, PYTHON, NIXL)

_logged: set[str] = set()


def log_once(message: str) -> None:
    """Log `message` at INFO the first time it is seen in this process."""
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def resolve_manager(requested: str, preferred: str | None) -> str:
    """`kv_cache.manager`: an explicit "v1"/"v2" stands; "auto" takes the model's
    preference, and V1 when the model states none."""
    _check_choice("kv_cache.manager", requested, MANAGER_CHOICES)
    if requested != AUTO:
        return requested
    if preferred is not None:
        _check_choice("the model's manager preference", preferred, (V1, V2))
        log_once(f"kv_cache.manager auto -> {preferred!r} (model preference)")
        return preferred
    log_once("kv_cache.manager auto -> 'v1' (model states no preference)")
    return V1


def resolve_transceiver(requested: str, preferred: str | None, nixl_importable: bool) -> str:
    """`cache_transceiver.backend`: "auto" takes the model's preference, else
    NIXL when the `nixl` package is importable, else Python.

    `nixl_importable`: the caller asks `transfer.nixl.agent.nixl_available()`,
    the same check the NIXL transceiver makes, so the two cannot disagree.
    """
    _check_choice("cache_transceiver.backend", requested, TRANSCEIVER_CHOICES)
    if requested == NIXL and not nixl_importable:
        raise ResolutionError(
            "cache_transceiver.backend is 'nixl' but the nixl package cannot be imported; "
            "install nixl or set cache_transceiver.backend to 'python' or 'auto'"
        )
    if requested != AUTO:
        return requested
    if preferred is not None:
        _check_choice("the model's transceiver preference", preferred, (PYTHON, NIXL))
        if preferred == NIXL and not nixl_importable:
            log_once(
                "cache_transceiver.backend auto -> 'python' (model prefers nixl; not importable)"
            )
            return PYTHON
        log_once(f"cache_transceiver.backend auto -> {preferred!r} (model preference)")
        return preferred
    chosen = NIXL if nixl_importable else PYTHON
    log_once(f"cache_transceiver.backend auto -> {chosen!r} (nixl importable: {nixl_importable})")
    return chosen


def resolve_cluster_managers(
    context_requested: str, generation_requested: str, preferred: str | None, transceiver: str
) -> tuple[str, str]:
    """(context manager, generation manager) for the whole cluster.

    Python transceiver: each side resolves on its own (it bridges V1 and V2).
    NIXL (raw memory by descriptor): both sides get one manager, and a side
    that resolves to V2 (explicitly or by the model's preference) is never
    demoted: a side whose V1 came from `auto` follows it to V2, while a side
    forced to V1 facing V2 raises LayoutConflictError naming both sections.
    """
    _check_choice("cache_transceiver.backend", transceiver, (PYTHON, NIXL))
    context = resolve_manager(context_requested, preferred)
    generation = resolve_manager(generation_requested, preferred)
    if transceiver == PYTHON or context == generation:
        return context, generation
    v1_requested = context_requested if context == V1 else generation_requested
    if v1_requested == V1:
        raise LayoutConflictError(
            f"kv_cache.manager is {_describe(context_requested, context)} on context_servers "
            f"but {_describe(generation_requested, generation)} on generation_servers; the "
            "NIXL backend needs one layout and a V2 choice is never demoted: set both to the "
            "same manager or use cache_transceiver.backend 'python'"
        )
    log_once("kv_cache.manager resolved to 'v2' on both sides: the NIXL backend needs one layout")
    return V2, V2


def _describe(requested: str, resolved: str) -> str:
    if requested == resolved:
        return repr(requested)
    return f"{requested!r} (resolved to {resolved!r} by the model's preference)"


def resolve_block_reuse(
    requested: bool, manager: str, is_hybrid: bool, snapshots: SnapshotPolicy | None = None
) -> bool:
    """`kv_cache.enable_block_reuse`: off unless asked, and only under V2; for a
    hybrid Mamba model only with a snapshot policy that takes snapshots (a KV
    prefix is reusable only where a Mamba state snapshot ends it)."""
    if not requested:
        return False
    if manager != V2:
        log_once(
            f"block reuse is off: it needs kv_cache.manager 'v2', this worker runs {manager!r}"
        )
        return False
    if is_hybrid and (snapshots is None or not snapshots.takes_any):
        log_once(
            "block reuse is off for this hybrid Mamba model: reusing a KV prefix needs Mamba "
            "state snapshots, and kv_cache.snapshots takes none (num_slots 0, or no interval, "
            "positions, at_end or on_demand)"
        )
        return False
    return True


def _check_choice(setting: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ResolutionError(f"{setting} must be one of {list(choices)}, got {value!r}")
