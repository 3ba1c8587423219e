"""Typed per-layer windows into the pool tensors, the cache as models see it.

`kvcache.tensors` builds these over its raw buffers; models write through
them and never allocate cache memory themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcache.snapshots import StateCopies


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

    def apply_loads(self, copies: StateCopies) -> None:
        """Before a step's forward: snapshot blocks and states into resuming requests'."""
        self._copy_blocks(copies.block_loads)
        self._copy_slots(copies.slot_loads)

    def apply_saves(self, copies: StateCopies) -> None:
        """After a step's forward: requests' states into their snapshot slots."""
        self._copy_slots(copies.slot_saves)

    def _copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        for layer in self.attention:
            for source, target in pairs:
                layer.key_cache[target].copy_(layer.key_cache[source])
                layer.value_cache[target].copy_(layer.value_cache[source])

    def _copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        for layer in self.mamba:
            for source, target in pairs:
                layer.conv_state[target].copy_(layer.conv_state[source])
                layer.ssm_state[target].copy_(layer.ssm_state[source])
