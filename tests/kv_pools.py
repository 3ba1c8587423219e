"""Attention caches laid out as the managers lay them out, for kernel tests.

The kernels read K/V through their strides; tests hand them the views the
engine hands them: one layer of a V1 per-layer pool or of a V2 block-major
pool (three layers, the middle one), head-outer blocks (`kvcache.pool_layout`).
"""

from __future__ import annotations

import torch

from kvcache.pool_layout import layout_for
from kvcache.spec import CacheSpec
from kvcache.tensors import allocate_cache_tensors
from kvcache.views import AttentionLayerCache

LAYERS = 3


def layer_cache(
    manager: str,
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
) -> AttentionLayerCache:
    """The middle layer's `[num_blocks, block_size, kv_heads, head_dim]` key and
    value views of a `manager` ("v1" | "v2") pool; random values when
    `generator` is given, else zeros."""
    dtype_name = str(dtype).removeprefix("torch.")
    spec = CacheSpec(
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        attention_layers=tuple(range(LAYERS)),
        dtype=dtype_name,
    )
    tensors = allocate_cache_tensors(layout_for(manager, spec, block_size, num_blocks, 0), device)
    cache = tensors.views().attention[1]
    if generator is not None:
        for view in (cache.key_cache, cache.value_cache):
            view.copy_(torch.randn(view.shape, generator=generator).to(view))
    return cache
