"""KV cache manager V2: one block-major pool, optional prefix reuse.

A block holds every attention layer's KV, `[num_blocks, kv_heads,
num_attn_layers, 2, block_size, head_dim]`, and a Mamba slot every Mamba layer's state,
so one block or one slot is one contiguous region (one NIXL descriptor).

With `enable_block_reuse`, full blocks are published under chained content
hashes; a new request takes the longest cached chain (`match_prefix`), and
unreferenced cached blocks are evicted least recently freed first. Blocks
received by transfer are published only once `finish_transfer` says their
bytes have arrived. A hybrid model resumes only where a Mamba state snapshot
ends the cached prefix (`kvcache.resume`, `kvcache.snapshots`).
"""

from __future__ import annotations

from kvcache.manager import KVCacheManager


class KVCacheManagerV2(KVCacheManager):
    """Block-major paged cache with opt-in prefix reuse; see `KVCacheManager`."""

    manager_name = "v2"
