"""One request's cache as the whole model holds it, and the part of it each
tensor-parallel rank holds, for head-slice transfer tests.

`WholeCache` draws random KV (per attention layer and logical block) and Mamba
state (per Mamba layer) for all heads. `write` puts a rank's heads of it into
that rank's pool through the typed views; `read` takes a rank's pool back out
as the same per-head tensors, so a test compares what arrived on a puller rank
with the whole cache's slice for that rank.
"""

from __future__ import annotations

import torch

from kvcache.manager import KVCacheManager
from kvcache.spec import CacheSpec, HeadShard
from kvcache.tensors import CacheTensors

Tensors = dict[str, torch.Tensor]

HYBRID_WHOLE = CacheSpec(  # 4 KV heads, 4 SSM heads of 4 channels, 2 groups of 8
    num_kv_heads=4,
    head_dim=8,
    attention_layers=(1, 3),
    mamba_layers=(0, 2),
    conv_state_shape=(4 * 4 + 2 * 2 * 8, 3),
    ssm_state_shape=(4, 4, 8),
)


class WholeCache:
    """Random cache contents of one request of `num_blocks` blocks, all heads."""

    def __init__(self, spec: CacheSpec, block_size: int, num_blocks: int, seed: int = 0) -> None:
        self.spec = spec
        gen = torch.Generator().manual_seed(seed)
        kv = (spec.num_attention_layers, num_blocks, 2, block_size, spec.num_kv_heads)
        self.kv = torch.randn(*kv, spec.head_dim, generator=gen)
        self.conv = torch.empty(0)
        self.ssm = torch.empty(0)
        if spec.is_hybrid:
            layers = len(spec.mamba_layers)
            self.conv = torch.randn(layers, *spec.conv_state_shape, generator=gen)
            self.ssm = torch.randn(layers, *spec.ssm_state_shape, generator=gen)

    def slice_for(self, shard: HeadShard) -> Tensors:
        """The part of this cache `shard` holds: KV heads, conv channels x | B | C
        of its heads and groups, SSM heads."""
        kv0, kv1 = shard.kv_heads
        out = {"kv": self.kv[:, :, :, :, kv0:kv1]}
        if self.spec.is_hybrid:
            _, head_dim, state_size = self.spec.ssm_state_shape
            h0, h1 = shard.mamba_heads
            g0, g1 = shard.mamba_groups
            x_end = shard.total_mamba_heads * head_dim
            groups = shard.total_mamba_groups * state_size
            channels = [
                self.conv[:, h0 * head_dim : h1 * head_dim],
                self.conv[:, x_end + g0 * state_size : x_end + g1 * state_size],
                self.conv[:, x_end + groups + g0 * state_size : x_end + groups + g1 * state_size],
            ]
            out["conv"] = torch.cat(channels, dim=1)
            out["ssm"] = self.ssm[:, h0:h1]
        return out


def write(tensors: CacheTensors, manager: KVCacheManager, request_id: str, part: Tensors) -> None:
    """Put `part` (`WholeCache.slice_for` this rank) into the request's blocks and slot."""
    views = tensors.views()
    blocks = manager.regions(request_id).block_ids
    for k, layer in enumerate(views.attention):
        for j, block in enumerate(blocks):
            layer.key_cache[block] = part["kv"][k, j, 0]
            layer.value_cache[block] = part["kv"][k, j, 1]
    slot = manager.regions(request_id).mamba_slot
    for m, state in enumerate(views.mamba):
        state.conv_state[slot] = part["conv"][m]
        state.ssm_state[slot] = part["ssm"][m]


def read(tensors: CacheTensors, manager: KVCacheManager, request_id: str) -> Tensors:
    """The request's cache on this rank, shaped as `write` takes it."""
    views = tensors.views()
    blocks = list(manager.regions(request_id).block_ids)
    kv = torch.stack(
        [
            torch.stack([layer.key_cache[blocks], layer.value_cache[blocks]], 1)
            for layer in views.attention
        ]
    )
    out = {"kv": kv}
    slot = manager.regions(request_id).mamba_slot
    if views.mamba:
        out["conv"] = torch.stack([state.conv_state[slot] for state in views.mamba])
        out["ssm"] = torch.stack([state.ssm_state[slot] for state in views.mamba])
    return out


def assert_equal(got: Tensors, expected: Tensors) -> None:
    assert got.keys() == expected.keys()
    for name in got:
        assert torch.equal(got[name], expected[name]), name
