"""Typed per-layer windows into the pool tensors, the cache as models see it.

`kvcache.tensors` builds these over its raw buffers; models write through
them and never allocate cache memory themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionLayerCache:
    """One attention layer's paged KV: both `[num_blocks, block_size, kv_heads, head_dim]`.

    The tensors may be strided views into a larger pool (V1 per-layer tensor or
    the V2 block-major buffer, both head-outer in memory: the offset stride is
    `head_dim`, a head's keys of a block one `[block_size, head_dim]` tile,
    the head stride `2 * block_size * head_dim` in V1 and `num_attn_layers`
    times that in V2); writes through them land in the pool. Kernels read
    them through their strides.
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor


@dataclass
class MambaLayerCache:
    """One Mamba layer's state pool, indexed by slot.

    conv_state: `[num_slots, conv_dim, conv_kernel - 1]` in the model dtype.
    ssm_state: `[num_slots, num_heads, head_dim, state_size]` in float32.
    """

    conv_state: torch.Tensor
    ssm_state: torch.Tensor


@dataclass
class CacheViews:
    """Caches by ordinal: `attention[k]` serves the k-th attention layer of
    `CacheSpec.attention_layers`, `mamba[k]` the k-th Mamba layer."""

    attention: list[AttentionLayerCache]
    mamba: list[MambaLayerCache]
