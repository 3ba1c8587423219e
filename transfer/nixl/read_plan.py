"""Which NIXL READs a pull makes: the layout check and the descriptor pairs.

NIXL moves raw memory by descriptor, so both sides must lay their cache out
identically (same manager, dtype, block size, layers): the signature is
compared before any byte moves. V1 <-> V2 needs the Python transceiver.
Ranks that hold the same heads read whole descriptors (a V2 block, a slot).
Between ranks of different tensor parallelism a READ descriptor is one run of
a head slice (`transfer.head_slices`): the K or the V heads a puller rank
takes from one block of one layer (longer where runs join up on both sides),
or one section of a Mamba state; its tables are prepared per (buffer, run
length, phase) like the whole-block ones.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kvcache.layout import LayoutSignature, RequestRegions
from transfer.errors import LayoutMismatch
from transfer.handle import TransferHandle, check_signature, parse_signature
from transfer.head_slices import check_shards, plan_head_slices, same_heads
from transfer.nixl.descriptors import PairGroups, group_arrays, group_slice_pairs
from transfer.plan import check_bounds
from transfer.region_arrays import descriptor_arrays


def check_layout(handle: TransferHandle, dest: LayoutSignature) -> LayoutSignature:
    """The holder's signature, checked against `dest` (cheap: it runs
    before the claim); `LayoutMismatch` unless both sides hold shards of
    one model and layout, or the same heads of one layout."""
    rid = handle.request_id
    if handle.agent_name is None or handle.agent_metadata is None:
        raise LayoutMismatch(rid, ["agent_name"], "handle has no NIXL agent")
    source = parse_signature(rid, handle.signature)
    check_shards(rid, source, dest)
    if same_heads(source, dest):
        # A replicated head may sit on a rank of another position.
        check_signature(rid, source, dest, ignore=("tp_size", "tp_rank"))
    return source


def plan_reads(
    handle: TransferHandle,
    source: LayoutSignature,
    dest_regions: RequestRegions,
    dest: LayoutSignature,
    sizes: Mapping[str, int],
) -> PairGroups:
    """The READs of this pull, grouped by descriptor table; `LayoutMismatch`
    unless the handle's cache fits `dest_regions` (in buffers of `sizes`
    bytes) byte for byte.

    Ranks that hold the same heads read whole descriptors (a V2 block, a
    slot); ranks of different tensor parallelism read one descriptor per
    run of a head slice (`transfer.head_slices`), K and V of each block.
    """
    rid = handle.request_id
    if not same_heads(source, dest):
        pairs = plan_head_slices(rid, source, handle.regions, dest, dest_regions)
        check_bounds(rid, [p.dest_span() for p in pairs], sizes)
        return group_slice_pairs(pairs)
    src_desc, dst_desc = descriptor_arrays(handle.regions), descriptor_arrays(dest_regions)
    if not np.array_equal(src_desc.lengths, dst_desc.lengths):
        raise LayoutMismatch(
            rid,
            ["descriptors"],
            f"the source has {len(src_desc)} descriptors, this side {len(dst_desc)}; "
            f"allocate as many blocks (and a Mamba slot) as the source holds",
        )
    check_bounds(rid, dst_desc, sizes)
    return group_arrays(src_desc, dst_desc)
