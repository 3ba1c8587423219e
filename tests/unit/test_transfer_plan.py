"""Transfer plans: pairing segments across V1/V2 layouts and merging contiguous runs."""

from __future__ import annotations

import gc
import random

import pytest

from kvcache.factory import create_manager
from kvcache.layout import Region, RequestRegions
from kvcache.manager import KVCacheManager
from kvcache.spec import CacheSpec
from tests.transfer_harness import BLOCK_SIZE, HYBRID
from transfer.errors import LayoutMismatch
from transfer.plan import Coverage, check_bounds, plan_ranges
from transfer.region_arrays import RegionArrays


def _request(manager: KVCacheManager, request_id: str, num_blocks: int) -> RequestRegions:
    assert manager.allocate_slots(request_id, num_blocks * BLOCK_SIZE)
    return manager.regions(request_id)


@pytest.mark.parametrize(
    "src_kind, dst_kind", [("v1", "v1"), ("v1", "v2"), ("v2", "v1"), ("v2", "v2")]
)
def test_every_segment_lands_on_its_counterpart(src_kind: str, dst_kind: str) -> None:
    src_manager = create_manager(src_kind, HYBRID, 16, BLOCK_SIZE, 2)
    dst_manager = create_manager(dst_kind, HYBRID, 16, BLOCK_SIZE, 2)
    _request(dst_manager, "other", 3)  # the destination's blocks start elsewhere
    src, dst = _request(src_manager, "r", 5), _request(dst_manager, "r", 5)

    _assert_every_segment_lands(src, dst, plan_ranges("r", src, dst))


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_blocks_out_of_order_land_on_their_counterparts(kind: str) -> None:
    """Tables whose ids descend on one side and interleave on the other pair
    up one for one (block j with block j)."""
    src = _scattered(kind, free_order=["e", "c", "a"])  # r gets blocks 5, 3, 1
    dst = _scattered(kind, free_order=["b", "e", "d"])  # r gets blocks 2, 5, 4
    assert src.block_ids == (5, 3, 1) and dst.block_ids == (2, 5, 4)
    _assert_every_segment_lands(src, dst, plan_ranges("r", src, dst))


def _scattered(kind: str, free_order: list[str]) -> RequestRegions:
    dense = CacheSpec(num_kv_heads=2, head_dim=4, attention_layers=(0, 2, 3))
    manager = create_manager(kind, dense, 6, BLOCK_SIZE, 0)  # blocks 1..5
    for name in "abcde":
        assert manager.allocate_slots(name, BLOCK_SIZE)
    for size, name in enumerate(free_order, start=1):  # r grows into each freed block
        manager.free(name)
        assert manager.allocate_slots("r", size * BLOCK_SIZE)
    return manager.regions("r")


def _assert_every_segment_lands(
    src: RequestRegions, dst: RequestRegions, pairs: list[tuple[Region, Region]]
) -> None:
    segments = src.contiguous_segments().items()
    destinations = dst.contiguous_segments()
    for key, s in segments:
        d = destinations[key]
        covering = [
            (ps, pd)
            for ps, pd in pairs
            if ps.buffer == s.buffer and ps.offset <= s.offset and s.end <= ps.end
        ]
        assert len(covering) == 1, key
        ps, pd = covering[0]
        assert (pd.buffer, pd.offset + s.offset - ps.offset) == (d.buffer, d.offset), key
    assert sum(s.length for s, _ in pairs) == sum(s.length for _, s in segments)


def test_v2_to_v2_in_order_blocks_merge_into_one_range_per_buffer() -> None:
    src_manager = create_manager("v2", HYBRID, 16, BLOCK_SIZE, 2)
    dst_manager = create_manager("v2", HYBRID, 16, BLOCK_SIZE, 2)
    src, dst = _request(src_manager, "r", 6), _request(dst_manager, "r", 6)

    pairs = plan_ranges("r", src, dst)

    kv_bytes = sum(r.length for r in src.descriptors if r.buffer == "kv")
    mamba_bytes = sum(r.length for r in src.mamba_segments.values())
    kv_start = min(r.offset for r in src.kv_segments.values())
    assert pairs == [
        (Region("kv", kv_start, kv_bytes), Region("kv", kv_start, kv_bytes)),
        (Region("mamba", 0, mamba_bytes), Region("mamba", 0, mamba_bytes)),
    ]


def test_runs_split_where_the_destination_is_not_contiguous() -> None:
    src_manager = create_manager("v1", HYBRID, 12, BLOCK_SIZE, 2)
    dst_manager = create_manager("v1", HYBRID, 12, BLOCK_SIZE, 2)
    src = _request(src_manager, "r", 4)
    _request(dst_manager, "a", 2)
    _request(dst_manager, "b", 9)
    dst_manager.free("a")
    dst_manager.free("b")
    dst = _request(dst_manager, "r", 4)
    blocks = dst.block_ids
    runs = 1 + sum(1 for x, y in zip(blocks, blocks[1:], strict=False) if y != x + 1)
    assert runs > 1  # the freed blocks come back out of order

    pairs = plan_ranges("r", src, dst)

    kv = [(s, d) for s, d in pairs if s.buffer.startswith("kv")]
    assert len(kv) == runs * len(HYBRID.attention_layers)
    assert sum(s.length for s, _ in kv) == sum(r.length for r in src.kv_segments.values())


def test_v1_to_v2_moves_each_head_of_each_layer_alone() -> None:
    """A V1 segment's heads are next to each other, a V2 segment's a block's
    layers apart: one range per head and segment, to the head's place."""
    src_manager = create_manager("v1", HYBRID, 16, BLOCK_SIZE, 2)
    dst_manager = create_manager("v2", HYBRID, 16, BLOCK_SIZE, 2)
    src, dst = _request(src_manager, "r", 3), _request(dst_manager, "r", 3)

    kv = [(s, d) for s, d in plan_ranges("r", src, dst) if s.buffer.startswith("kv")]

    assert len(kv) == len(src.kv_segments) * HYBRID.num_kv_heads
    assert {s.length for s, _ in kv} == {src.kv_head_bytes}
    pieces = [r for key, r in dst.contiguous_segments().items() if len(key) == 3]
    assert {d for _, d in kv} == set(pieces)


def test_mismatched_block_counts_name_what_to_allocate() -> None:
    src_manager = create_manager("v2", HYBRID, 16, BLOCK_SIZE, 2)
    dst_manager = create_manager("v2", HYBRID, 16, BLOCK_SIZE, 2)
    src, dst = _request(src_manager, "r", 4), _request(dst_manager, "r", 3)

    with pytest.raises(LayoutMismatch, match="lacks 2 and has 0 extra segments"):
        plan_ranges("r", src, dst)


def test_a_large_plan_makes_no_tracked_object_per_segment() -> None:
    spec = HYBRID
    src_manager = create_manager("v1", spec, 2050, BLOCK_SIZE, 2)
    dst_manager = create_manager("v1", spec, 2050, BLOCK_SIZE, 2)
    _request(dst_manager, "other", 7)
    src, dst = _request(src_manager, "r", 2000), _request(dst_manager, "r", 2000)
    num_segments = len(src.kv_segments) + len(src.mamba_segments)

    gc.collect()
    gc.disable()
    try:
        before = gc.get_count()[0]
        pairs = plan_ranges("r", src, dst)
        allocated = gc.get_count()[0] - before
    finally:
        gc.enable()

    assert num_segments == 4004
    # A few lists per source buffer and two Regions per merged range.
    assert allocated < 4 * len(pairs) + 40, (allocated, len(pairs))


def test_coverage_joins_overlapping_and_adjacent_regions_per_buffer() -> None:
    coverage = Coverage(
        [Region("a", 100, 50), Region("a", 0, 40), Region("a", 40, 10), Region("a", 120, 100)]
        + [Region("b", 10, 5)]
    )
    # runs: a [0, 50) and [100, 220); b [10, 15)
    assert coverage.covers("a", 0, 50) and coverage.covers("a", 100, 120)
    assert coverage.covers("a", 140, 80) and coverage.covers("b", 10, 5)
    assert not coverage.covers("a", 45, 10)  # across the gap
    assert not coverage.covers("a", 50, 1) and not coverage.covers("a", 219, 2)
    assert not coverage.covers("b", 9, 2) and not coverage.covers("c", 0, 1)
    assert not coverage.covers("a", 0, 0) and not coverage.covers("a", -1, 2)


def test_coverage_agrees_with_a_byte_map_on_random_regions() -> None:
    rng = random.Random(5)
    regions = [
        Region(rng.choice("xy"), rng.randrange(0, 400), rng.randrange(1, 40)) for _ in range(60)
    ]
    covered = {(r.buffer, b) for r in regions for b in range(r.offset, r.end)}
    coverage = Coverage(RegionArrays.of(regions))
    for _ in range(2000):
        buffer, offset, length = rng.choice("xyz"), rng.randrange(-5, 450), rng.randrange(1, 60)
        inside = all((buffer, b) in covered for b in range(offset, offset + length))
        # One published run must hold the whole range; runs that merely touch are one run.
        assert coverage.covers(buffer, offset, length) == (inside and offset >= 0)


def test_check_bounds_names_the_first_region_outside_the_buffers() -> None:
    sizes = {"kv": 100, "mamba": 10}
    check_bounds("r", [Region("kv", 0, 100), Region("mamba", 2, 8)], sizes)
    for bad in (Region("kv", 90, 11), Region("kv", -1, 2), Region("other", 0, 1)):
        with pytest.raises(LayoutMismatch, match=rf"region {bad.buffer}\[{bad.offset}:"):
            check_bounds("r", [Region("kv", 0, 10), bad, Region("kv", 95, 20)], sizes)
