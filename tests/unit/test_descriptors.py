"""Regions and descriptors against the bytes the per-layer views really write."""

from __future__ import annotations

import pickle

import pytest
import torch

from kvcache.factory import create_manager
from kvcache.layout import CONV, SSM, LayoutSignature, Region
from kvcache.manager import KVCacheManager
from kvcache.pool_layout import BlockMajorLayout
from kvcache.spec import CacheSpec
from kvcache.tensors import CacheTensors, allocate_cache_tensors
from transfer.handle import regions_from_dict, regions_to_dict

BLOCK_SIZE = 4
# bf16 KV and conv state (conv: 36 bytes, not 16-aligned), float32 SSM state.
HYBRID = CacheSpec(
    num_kv_heads=2,
    head_dim=4,
    attention_layers=(1, 3),
    dtype="bfloat16",
    mamba_layers=(0, 2),
    conv_state_shape=(6, 3),
    ssm_state_shape=(2, 4, 5),
)
MARK = 0xAB


def build(name: str, other_tokens: int) -> tuple[KVCacheManager, CacheTensors]:
    """A manager whose request "a" (10 tokens, 3 blocks) sits after another
    request of `other_tokens` tokens, so physical ids depend on `other_tokens`."""
    manager = create_manager(name, HYBRID, 11, BLOCK_SIZE, 3)
    if other_tokens:
        assert manager.allocate_slots("other", other_tokens)
    assert manager.allocate_slots("a", 10)
    return manager, allocate_cache_tensors(manager)


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("name", ["v1", "v2"])
def test_views_have_the_model_contract_shapes(name: str) -> None:
    _, tensors = build(name, 0)
    views = tensors.views()
    assert len(views.attention) == 2 and len(views.mamba) == 2
    assert views.attention[1].key_cache.shape == (11, BLOCK_SIZE, 2, 4)
    assert views.attention[1].value_cache.dtype == torch.bfloat16
    assert views.mamba[0].conv_state.shape == (3, 6, 3)
    assert views.mamba[0].conv_state.dtype == torch.bfloat16
    assert views.mamba[1].ssm_state.shape == (3, 2, 4, 5)
    assert views.mamba[1].ssm_state.dtype == torch.float32
    assert all(b.dtype == torch.uint8 and b.dim() == 1 for b in tensors.buffers().values())


@pytest.mark.parametrize("name", ["v1", "v2"])
def test_pattern_written_through_views_reads_back_through_regions(name: str) -> None:
    manager, tensors = build(name, 5)
    views, regions = tensors.views(), manager.regions("a")
    gen = torch.Generator().manual_seed(0)
    slot = manager.mamba_slot("a")
    assert slot is not None and regions.mamba_slot == slot
    for k, layer in enumerate(views.attention):
        for j, block_id in enumerate(regions.block_ids):
            layer.key_cache[block_id] = torch.randn(BLOCK_SIZE, 2, 4, generator=gen)
            layer.value_cache[block_id] = torch.randn(BLOCK_SIZE, 2, 4, generator=gen)
            # A segment: per head a piece, its keys then its values [2, block_size, head_dim].
            pair = torch.stack([layer.key_cache[block_id], layer.value_cache[block_id]])
            pieces = regions.kv_pieces(regions.kv_segments[(k, j)])
            assert len(pieces) == 2
            for h, piece in enumerate(pieces):
                assert tensors.read_region(piece) == as_bytes(pair[:, :, h])
    for m, state in enumerate(views.mamba):
        state.conv_state[slot] = torch.randn(6, 3, generator=gen)
        state.ssm_state[slot] = torch.randn(2, 4, 5, generator=gen)
        assert tensors.read_region(regions.mamba_segments[(m, CONV)]) == as_bytes(
            state.conv_state[slot]
        )
        assert tensors.read_region(regions.mamba_segments[(m, SSM)]) == as_bytes(
            state.ssm_state[slot]
        )


def masks(tensors: CacheTensors, regions: list[Region]) -> dict[str, torch.Tensor]:
    out = {name: torch.zeros_like(buf, dtype=torch.bool) for name, buf in tensors.buffers().items()}
    for region in regions:
        out[region.buffer][region.offset : region.end] = True
    return out


@pytest.mark.parametrize("name", ["v1", "v2"])
def test_regions_cover_exactly_the_bytes_of_the_requests_blocks_and_slot(name: str) -> None:
    manager, tensors = build(name, 5)
    views, regions = tensors.views(), manager.regions("a")
    slot = regions.mamba_slot
    assert slot is not None
    for layer in views.attention:
        for block_id in regions.block_ids:
            layer.key_cache[block_id].view(torch.uint8).fill_(MARK)
            layer.value_cache[block_id].view(torch.uint8).fill_(MARK)
    for state in views.mamba:
        state.conv_state[slot].view(torch.uint8).fill_(MARK)
        state.ssm_state[slot].view(torch.uint8).fill_(MARK)

    segments = list(regions.contiguous_segments().values())
    seg_mask, desc_mask = masks(tensors, segments), masks(tensors, list(regions.descriptors))
    for buf_name, buf in tensors.buffers().items():
        assert torch.equal(buf == MARK, seg_mask[buf_name]), buf_name
        assert not (seg_mask[buf_name] & ~desc_mask[buf_name]).any(), "segment outside descriptors"
        assert not buf[desc_mask[buf_name] & ~seg_mask[buf_name]].any(), "padding only"
    assert sum(r.length for r in segments) == sum(int(m.sum()) for m in seg_mask.values())
    segment_bytes = (
        3 * 2 * HYBRID.kv_bytes_per_block_per_layer(BLOCK_SIZE) + HYBRID.mamba_bytes_per_slot
    )
    assert sum(r.length for r in segments) == segment_bytes
    if name == "v2":
        assert len(regions.descriptors) == 3 + 1  # one per block, one for the slot
        layout = manager.layout
        assert isinstance(layout, BlockMajorLayout)
        assert regions.num_bytes == 3 * layout.block_bytes + manager.layout.slot_bytes
    else:
        assert len(regions.descriptors) == 2 * 3 + 2 * 2  # per (layer, block), per (layer, kind)
        assert regions.num_bytes == segment_bytes


def test_v1_segments_scatter_into_v2_blocks_one_for_one() -> None:
    v1, t1 = build("v1", 0)
    v2, t2 = build("v2", 7)
    r1, r2 = v1.regions("a"), v2.regions("a")
    assert r1.block_ids != r2.block_ids, "the bridge must not depend on equal ids"
    assert r1.kv_segments.keys() == r2.kv_segments.keys()
    assert r1.mamba_segments.keys() == r2.mamba_segments.keys()
    gen = torch.Generator().manual_seed(1)
    for buf in t1.buffers().values():
        buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8))
    pieces = r2.contiguous_segments()
    pairs = [(src, pieces[key]) for key, src in r1.contiguous_segments().items()]
    for src, dst in pairs:
        assert src.length == dst.length
        t2.write_region(dst, t1.read_region(src))
    v1_views, v2_views = t1.views(), t2.views()
    for k in range(2):
        for b1, b2 in zip(r1.block_ids, r2.block_ids, strict=True):
            a, b = v1_views.attention[k], v2_views.attention[k]
            assert torch.equal(a.key_cache[b1].view(torch.int16), b.key_cache[b2].view(torch.int16))
            assert torch.equal(
                a.value_cache[b1].view(torch.int16), b.value_cache[b2].view(torch.int16)
            )
    s1, s2 = r1.mamba_slot, r2.mamba_slot
    for m in range(2):
        assert torch.equal(
            v1_views.mamba[m].ssm_state[s1].view(torch.int32),
            v2_views.mamba[m].ssm_state[s2].view(torch.int32),
        )
        assert torch.equal(
            v1_views.mamba[m].conv_state[s1].view(torch.int16),
            v2_views.mamba[m].conv_state[s2].view(torch.int16),
        )


def test_layout_signature_round_trip_and_diff() -> None:
    v1, _ = build("v1", 0)
    v2, _ = build("v2", 0)
    sig1, sig2 = v1.layout_signature(), v2.layout_signature()
    assert LayoutSignature.from_dict(sig1.to_dict()) == sig1
    assert sig1.ssm_dtype == "float32" and sig1.conv_dtype == "bfloat16"
    assert sig1.attention_layers == (1, 3) and sig1.mamba_layers == (0, 2)
    assert sig1.diff(sig2) == ["manager: 'v1' != 'v2'"]
    assert sig1.diff(sig2, ignore=("manager",)) == []
    other = create_manager("v1", HYBRID, 11, 8, 3).layout_signature()
    assert sig1.diff(other) == ["block_size: 4 != 8"]
    with pytest.raises(ValueError, match="unknown layout signature fields"):
        LayoutSignature.from_dict({**sig1.to_dict(), "bogus": 1})


def test_region_outside_a_buffer_is_rejected() -> None:
    _, tensors = build("v2", 0)
    size = tensors.buffers()["kv"].numel()
    with pytest.raises(ValueError, match="outside buffer"):
        tensors.read_region(Region("kv", size - 4, 8))
    with pytest.raises(ValueError, match="do not fit"):
        tensors.write_region(Region("kv", 0, 8), b"\x00" * 4)


@pytest.mark.parametrize("name", ["v1", "v2"])
def test_a_long_request_travels_as_its_block_table_not_a_region_per_segment(name: str) -> None:
    """32 layers x 2,048 blocks are 65,536 KV segments; what a handle carries
    (pickled, or as the wire's dict) is the block table and a few numbers per
    layer, and the per-segment views come back the same on the other side."""
    spec = CacheSpec(num_kv_heads=2, head_dim=8, attention_layers=tuple(range(32)))
    manager = create_manager(name, spec, 2100, BLOCK_SIZE, 1)
    assert manager.allocate_slots("r", 2048 * BLOCK_SIZE)
    regions = manager.regions("r")
    size = len(pickle.dumps(regions))
    segments, descriptors = dict(regions.kv_segments), regions.descriptors  # built and cached
    assert len(segments) == 32 * 2048
    assert len(descriptors) == (32 * 2048 if name == "v1" else 2048)
    assert len(pickle.dumps(regions)) == size < 8 * 2048  # the block ids, not the views
    for back in (pickle.loads(pickle.dumps(regions)), regions_from_dict(regions_to_dict(regions))):
        assert back == regions
        assert back.kv_segments == segments and back.descriptors == descriptors
    assert regions.num_bytes == sum(r.length for r in descriptors)
