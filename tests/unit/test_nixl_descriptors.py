"""Grouping a pull's descriptors by prepared table (no NIXL needed)."""

from __future__ import annotations

import numpy as np

from kvcache.layout import Region
from transfer.head_slices import SlicePair
from transfer.nixl.descriptors import PairGroups, group_arrays, group_slice_pairs
from transfer.region_arrays import RegionArrays


def as_lists(groups: PairGroups) -> dict[object, tuple[list[int], list[int]]]:
    return {key: (local.tolist(), remote.tolist()) for key, (local, remote) in groups.items()}


def per_run(pairs: list[SlicePair]) -> PairGroups:
    src = tuple(Region(p.src_buffer, o, n) for p in pairs for o, n in p.source_runs())
    dst = tuple(Region(p.dst_buffer, o, n) for p in pairs for o, n in p.dest_runs())
    return group_arrays(RegionArrays.of(src), RegionArrays.of(dst))


def test_head_slice_runs_group_as_one_region_per_run_would() -> None:
    pairs = [
        # K and V halves of two layers' blocks: strided on the puller side.
        SlicePair("kv.0", 0, "kv.0", 4096, 4096, 6, 4096, 8192),
        SlicePair("kv.1", 8192, "kv.1", 16384, 4096, 3, 4096, 8192),
        # A stride that is not a multiple of the run: phases alternate.
        SlicePair("kv.0", 100_000, "kv.1", 50_000, 3000, 5, 4500, 3000),
        # Contiguous ranges (Mamba state) of two lengths in one buffer.
        SlicePair("mamba", 64, "mamba", 0, 512, 1, 512, 512),
        SlicePair("mamba", 1024, "mamba", 512, 96, 1, 96, 96),
    ]
    got = group_slice_pairs(pairs)
    assert as_lists(got) == as_lists(per_run(pairs))
    assert all(a.dtype == b.dtype == np.int32 for a, b in got.values())
    # The alternating phases land in two tables of each side.
    phases = {(local[2], remote[2]) for local, remote in got if local[1] == 3000}
    assert phases == {(2000, 1000), (2000, 2500)}


def test_no_pairs_is_no_groups() -> None:
    assert group_slice_pairs([]) == {}
