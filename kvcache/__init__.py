"""KV cache bookkeeping, layouts, pool tensors, sizing and the `auto` rules.

Modules, by concept (only `tensors` imports torch):

    spec          CacheSpec: what a model needs from the cache
    block, free_queue, block_pool   physical blocks, O(1) free queue, ref counts
    hashing, events                 chained block hashes, KV events for routers
    mamba_pool    one Mamba state slot per running request
    manager       the shared manager API; manager_v1 / manager_v2 the two layouts
    factory       create_manager("v1" | "v2", ...)
    layout, pool_layout             Region, RequestRegions, LayoutSignature; byte layouts
    tensors       allocate_cache_tensors: raw buffers and per-layer views
    sizing        blocks and slots from max_tokens or a memory budget
    resolution    resolve_manager / _transceiver / _cluster_managers / _block_reuse
    errors        exception types
"""
