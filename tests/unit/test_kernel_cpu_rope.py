"""The C rotary + K/V cache write kernel against torch's `apply_rotary` and `write_kv`."""

from __future__ import annotations

import pytest
import torch

from kvcache.views import AttentionLayerCache
from models.kernels import cpu_build, cpu_rope
from models.layers.rotary import apply_rotary
from tests.kv_pools import layer_cache

pytestmark = pytest.mark.skipif(
    cpu_build.load("rope_cache") is None, reason="no C compiler to build the CPU kernels"
)

HEADS, KV_HEADS, BLOCK, BLOCKS = 4, 2, 4, 9


def _inputs(
    dtype: torch.dtype, tokens: int, dim: int, rot_dim: int, layout: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionLayerCache, torch.Tensor]:
    gen = torch.Generator().manual_seed(tokens * dim)
    qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, dim, generator=gen).to(dtype)
    angles = torch.rand(tokens, rot_dim // 2, generator=gen) * 6
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    cache = layer_cache(layout, BLOCKS, BLOCK, KV_HEADS, dim, dtype)
    slots = torch.randperm(BLOCKS * BLOCK, generator=gen)[:tokens]
    return qkv, cos, sin, cache, slots


def _reference(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: AttentionLayerCache,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated qkv and the caches written the torch way."""
    qkv = qkv.clone()
    qkv[:, : HEADS + KV_HEADS] = apply_rotary(qkv[:, : HEADS + KV_HEADS], cos, sin)
    keys, values = cache.key_cache.clone(), cache.value_cache.clone()
    blocks, offsets = slots // BLOCK, slots % BLOCK
    keys[blocks, offsets] = qkv[:, HEADS : HEADS + KV_HEADS]
    values[blocks, offsets] = qkv[:, HEADS + KV_HEADS :]
    return qkv, keys, values


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout", ["v1", "v2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "dim", "rot_dim"), [(5, 16, 16), (33, 24, 8), (1, 64, 64)])
def test_matches_torch_rotation_and_cache_write(
    monkeypatch: pytest.MonkeyPatch,
    threads: int,
    layout: str,
    dtype: torch.dtype,
    tokens: int,
    dim: int,
    rot_dim: int,
) -> None:
    monkeypatch.setattr(cpu_rope, "_PARALLEL_TOKENS", 0 if threads > 1 else 1 << 30)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    qkv, cos, sin, cache, slots = _inputs(dtype, tokens, dim, rot_dim, layout)
    want_qkv, want_keys, want_values = _reference(qkv, cos, sin, cache, slots)
    assert cpu_rope.supported(qkv, cos, sin, cache.key_cache, cache.value_cache)
    cpu_rope.rope_and_cache(qkv, cos, sin, HEADS, cache.key_cache, cache.value_cache, slots, BLOCK)
    tolerance = {"atol": 1e-6, "rtol": 1e-6}  # fp32 may fuse a multiply-add
    torch.testing.assert_close(qkv, want_qkv, **tolerance)
    torch.testing.assert_close(cache.key_cache, want_keys, **tolerance)
    assert torch.equal(cache.value_cache, want_values)  # V is copied as is
    if dtype == torch.bfloat16:  # each product and the sum rounded as torch rounds them
        assert torch.equal(qkv, want_qkv)


def test_negative_slots_are_not_written() -> None:
    qkv, cos, sin, cache, _ = _inputs(torch.float32, 3, 16, 16, "v1")
    slots = torch.tensor([5, -1, 7])
    cpu_rope.rope_and_cache(qkv, cos, sin, HEADS, cache.key_cache, cache.value_cache, slots, BLOCK)
    written = (cache.key_cache != 0).any(dim=(-1, -2)).nonzero().tolist()
    assert written == [[1, 1], [1, 3]]


def test_unsupported_inputs_are_refused() -> None:
    qkv, cos, sin, cache, slots = _inputs(torch.float16, 3, 16, 16, "v1")
    assert not cpu_rope.supported(qkv, cos, sin, cache.key_cache, cache.value_cache)
    qkv32, cos32, sin32, cache32, _ = _inputs(torch.float32, 3, 16, 16, "v1")
    odd = cos32[:, :15]
    assert not cpu_rope.supported(qkv32, odd, odd, cache32.key_cache, cache32.value_cache)
    with pytest.raises(cpu_rope.RopeKernelError):
        cpu_rope.rope_and_cache(
            qkv, cos, sin, HEADS, cache.key_cache, cache.value_cache, slots, BLOCK
        )
    with pytest.raises(cpu_rope.RopeKernelError, match="heads"):
        cpu_rope.rope_and_cache(
            qkv32, cos32, sin32, HEADS + 1, cache32.key_cache, cache32.value_cache, slots, BLOCK
        )
