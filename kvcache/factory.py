"""Build the manager a worker's resolved configuration names."""

from __future__ import annotations

from kvcache.manager import KVCacheManager
from kvcache.manager_v1 import KVCacheManagerV1
from kvcache.manager_v2 import KVCacheManagerV2
from kvcache.snapshots import SnapshotPolicy
from kvcache.spec import CacheSpec

MANAGER_CLASSES: dict[str, type[KVCacheManager]] = {"v1": KVCacheManagerV1, "v2": KVCacheManagerV2}


def create_manager(
    manager: str,
    spec: CacheSpec,
    num_blocks: int,
    block_size: int,
    num_mamba_slots: int = 0,
    *,
    enable_block_reuse: bool = False,
    hash_namespace: str = "",
    snapshots: SnapshotPolicy | None = None,
    num_verify_slots: int = 0,
    verify_depth: int = 0,
) -> KVCacheManager:
    """A V1 or V2 manager; `manager` must already be resolved (not "auto")."""
    cls = MANAGER_CLASSES.get(manager)
    if cls is None:
        raise ValueError(f"kv_cache.manager must be 'v1' or 'v2' here, got {manager!r}")
    return cls(
        spec,
        num_blocks,
        block_size,
        num_mamba_slots,
        enable_block_reuse=enable_block_reuse,
        hash_namespace=hash_namespace,
        snapshots=snapshots,
        num_verify_slots=num_verify_slots,
        verify_depth=verify_depth,
    )
