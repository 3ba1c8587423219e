"""KV cache manager V1: layer-major pools, a plain free-list allocator, no reuse.

Each attention layer owns a tensor `[num_blocks, 2, kv_heads, block_size,
head_dim]` and each Mamba layer a per-kind slot tensor (see `pool_layout`);
moving one block to another worker takes one region per layer. Prefix reuse is
never on: `match_prefix` returns 0 and blocks are never shared.
"""

from __future__ import annotations

from kvcache.manager import KVCacheManager


class KVCacheManagerV1(KVCacheManager):
    """Layer-major paged cache; see `KVCacheManager` for the API."""

    manager_name = "v1"
