"""Head-slice plans: what one generation rank reads from one context rank when
the two instances split the model's heads differently (tensor parallelism).

Each rank's cache holds the heads its `LayoutSignature` names (`kv_heads`,
`mamba_heads`, `mamba_groups`, in the whole model's numbering). A puller rank
reads, from each holder rank, the heads it needs that this holder *owns*: the
part of the holder's heads that no lower holder rank holds, so a head
replicated on several holder ranks is read once, from the lowest.

Where the heads sit inside one segment:

    KV segment  kv_heads pieces [2][block_size][head_dim], one per head
                (`kvcache.pool_layout`); a V2 block holds each head's pieces
                of all layers next to each other, so a head range of a
                block is one run through all layers:
                  src  |h0 L0 L1|h1 L0 L1|h2 L0 L1|h3 L0 L1|  (holder: 4 heads)
                  dst                     |h2 L0 L1|h3 L0 L1| (puller: 2 heads)
                In V1 a head range is one run per (layer, block).
    conv state  [conv_dim][kernel - 1], channels x | B | C: one run per
                section (x channels follow the SSM heads, B and C the groups)
    SSM state   [heads][head_dim][state_size]: one run

Pairs that continue each other on both sides (the next head or layer of a
V2 block, the next block of a run of blocks) merge into one. A pair whose
rows are whole on both sides is one contiguous range.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from kvcache.dtypes import DTYPE_BYTES
from kvcache.layout import SSM, LayoutSignature, Region, RequestRegions
from kvcache.spec import HeadShard, Span, head_shard
from transfer.errors import LayoutMismatch
from transfer.handle import check_signature, parse_signature
from transfer.plan import Runs, check_same_kv_keys, kv_piece_runs, plan_ranges


class SlicePair(NamedTuple):
    """`num_runs` runs of `run` bytes: source run i at `src_offset + i *
    src_stride` of `src_buffer` lands at `dst_offset + i * dst_stride` of
    `dst_buffer`. A contiguous range has `num_runs` 1."""

    src_buffer: str
    src_offset: int
    dst_buffer: str
    dst_offset: int
    run: int
    num_runs: int
    src_stride: int
    dst_stride: int

    @property
    def num_bytes(self) -> int:
        return self.run * self.num_runs

    @property
    def source_is_contiguous(self) -> bool:
        return self.num_runs == 1 or self.src_stride == self.run

    @property
    def dest_is_contiguous(self) -> bool:
        return self.num_runs == 1 or self.dst_stride == self.run

    def wire_range(self) -> list[str | int]:
        """The source as a pull frame names it: `[buffer, offset, length]`
        when contiguous, else `[buffer, offset, run, count, stride]`."""
        if self.source_is_contiguous:
            return [self.src_buffer, self.src_offset, self.num_bytes]
        return [self.src_buffer, self.src_offset, self.run, self.num_runs, self.src_stride]

    def source_span(self) -> tuple[str, int, int]:
        """(buffer, offset, length) of the source bytes the runs lie in."""
        return self.src_buffer, self.src_offset, (self.num_runs - 1) * self.src_stride + self.run

    def dest_span(self) -> Region:
        length = (self.num_runs - 1) * self.dst_stride + self.run
        return Region(self.dst_buffer, self.dst_offset, length)

    def source_runs(self) -> Iterator[tuple[int, int]]:
        """(offset, length) of each source run."""
        for i in range(self.num_runs):
            yield self.src_offset + i * self.src_stride, self.run

    def dest_runs(self) -> Iterator[tuple[int, int]]:
        for i in range(self.num_runs):
            yield self.dst_offset + i * self.dst_stride, self.run


def plan_pull(
    request_id: str,
    source: dict[str, Any],
    src: RequestRegions,
    dest: LayoutSignature,
    dst: RequestRegions,
) -> list[SlicePair]:
    """What a puller reads from one holder, checked before any byte moves.

    `source` is the holder's signature as its handle carries it. Between
    ranks that hold the same heads (one rank each, or equal tensor
    parallelism) whole segments move, paired by key, which also bridges V1
    and V2; otherwise the head slices this holder owns and the puller needs.
    Raises `LayoutMismatch` when the two are not shards of one model and
    layout, or the destination's segments do not match the source's.
    """
    holder = parse_signature(request_id, source)
    check_shards(request_id, holder, dest)
    if same_heads(holder, dest):
        # V1 <-> V2 is bridged segment by segment, and the same heads may sit
        # on ranks of different position (a replicated KV head); the rest agrees.
        check_signature(request_id, holder, dest, ignore=("manager", "tp_size", "tp_rank"))
        return [
            SlicePair(s.buffer, s.offset, d.buffer, d.offset, s.length, 1, s.length, d.length)
            for s, d in plan_ranges(request_id, src, dst)
        ]
    return plan_head_slices(request_id, holder, src, dest, dst)


def same_heads(source: LayoutSignature, dest: LayoutSignature) -> bool:
    """True when the puller needs exactly the heads the holder holds and owns
    (one rank each, or equal tensor parallelism, same rank): segments then
    move whole."""
    shard = source.head_shard()
    return _owned(shard) == shard.ranges() == dest.head_shard().ranges()


def check_shards(request_id: str, source: LayoutSignature, dest: LayoutSignature) -> None:
    """Raise `LayoutMismatch` unless both sides hold shards of one model and
    layout (`whole()` equal but for the manager) and name their heads by the
    sharding rule (`kvcache.spec.head_shard`)."""
    differing = source.whole().diff(dest.whole(), ignore=("manager",))
    if differing:
        raise LayoutMismatch(request_id, differing)
    for side, signature in (("holder", source), ("puller", dest)):
        shard = signature.head_shard()
        expected = _rule(shard, shard.rank)
        if shard.ranges() != expected.ranges():
            raise LayoutMismatch(
                request_id,
                ["kv_heads", "mamba_heads", "mamba_groups"],
                f"the {side}'s rank {shard.rank} of {shard.size} names heads "
                f"{shard.ranges()}, the sharding rule gives {expected.ranges()}",
            )


def plan_head_slices(
    request_id: str,
    source: LayoutSignature,
    src: RequestRegions,
    dest: LayoutSignature,
    dst: RequestRegions,
) -> list[SlicePair]:
    """The head slices the puller (`dest`, `dst`) reads from this holder
    (`source`, `src`): every head it needs that the holder owns, merged where
    contiguous, ordered by source address. Call `check_shards` first."""
    _check_keys(request_id, src, dst)
    owned = _owned(source.head_shard())
    needed = dest.head_shard().ranges()
    take = {name: _intersect(owned[name], needed[name]) for name in owned}
    pairs: list[SlicePair] = []
    if take["kv_heads"] is not None:
        pairs += _kv_pairs(request_id, source, src, dest, dst, take["kv_heads"])
    for key, s in src.mamba_segments.items():
        d = dst.mamba_segments[key]
        if key[1] == SSM:
            pairs += _ssm_pairs(source, s, dest, d, take["mamba_heads"])
        else:
            pairs += _conv_pairs(source, s, dest, d, take)
    return _merge(sorted(pairs, key=lambda p: (p.src_buffer, p.src_offset)))


def _rule(shard: HeadShard, rank: int) -> HeadShard:
    return head_shard(
        rank, shard.size, shard.total_kv_heads, shard.total_mamba_heads, shard.total_mamba_groups
    )


def _owned(shard: HeadShard) -> dict[str, Span]:
    """The part of each of the holder's ranges that no lower rank holds."""
    ranges = shard.ranges()
    if shard.rank == 0:
        return ranges
    below = _rule(shard, shard.rank - 1).ranges()
    return {name: (max(start, below[name][1]), stop) for name, (start, stop) in ranges.items()}


def _intersect(a: Span, b: Span) -> Span | None:
    start, stop = max(a[0], b[0]), min(a[1], b[1])
    return (start, stop) if start < stop else None


def _check_keys(request_id: str, src: RequestRegions, dst: RequestRegions) -> None:
    check_same_kv_keys(request_id, src, dst)
    if src.mamba_segments.keys() != dst.mamba_segments.keys():
        raise LayoutMismatch(
            request_id,
            ["mamba_segments"],
            f"the destination has {len(dst.mamba_segments)} segments where the source has "
            f"{len(src.mamba_segments)}; allocate as many blocks (and a Mamba slot) as the "
            "source holds",
        )


def _kv_pairs(
    request_id: str,
    source: LayoutSignature,
    src: RequestRegions,
    dest: LayoutSignature,
    dst: RequestRegions,
    heads: Span,
) -> list[SlicePair]:
    firsts = (source.kv_heads[0], dest.kv_heads[0])
    counts = (source.num_kv_heads, dest.num_kv_heads)
    return _progressions(kv_piece_runs(request_id, src, dst, heads, firsts, counts))


def _progressions(runs: Runs) -> list[SlicePair]:
    """Runs as strided pairs: equal runs at equal steps on both sides (a head
    range of consecutive blocks) become one pair, taken greedily from the
    first run: a run and the next set the steps, and the pair extends while
    the runs after keep them.

    A large request is tens of thousands of runs but a few pairs, so the
    steps are compared with array operations and the loop visits one pair
    at a time, never one run."""
    sb, so, db, do, ln = runs.src_code, runs.src_at, runs.dst_code, runs.dst_at, runs.length
    n = int(so.size)
    src_step, dst_step = np.diff(so), np.diff(do)
    # Run i + 1 may follow run i in a pair: same buffers and length, steps of at least a run.
    linked = (
        (sb[1:] == sb[:-1])
        & (db[1:] == db[:-1])
        & (ln[1:] == ln[:-1])
        & (src_step >= ln[:-1])
        & (dst_step >= ln[:-1])
    )
    # The pair that took runs i and i + 1 also takes run i + 2.
    keeps = linked[1:] & (src_step[1:] == src_step[:-1]) & (dst_step[1:] == dst_step[:-1])
    breaks = np.flatnonzero(~keeps)
    names = runs.names
    pairs = []
    i = 0
    while i < n:
        length = int(ln[i])
        if i + 1 < n and linked[i]:
            b = int(np.searchsorted(breaks, i))
            last = int(breaks[b]) + 1 if b < breaks.size else n - 1
            steps = (int(src_step[i]), int(dst_step[i]))
        else:
            last, steps = i, (length, length)
        pairs.append(
            SlicePair(
                names[sb[i]], int(so[i]), names[db[i]], int(do[i]), length, last - i + 1, *steps
            )
        )
        i = last + 1
    return pairs


def _contiguous(s: Region, src_start: int, d: Region, dst_start: int, length: int) -> SlicePair:
    return SlicePair(
        s.buffer, s.offset + src_start, d.buffer, d.offset + dst_start, length, 1, length, length
    )


def _ssm_pairs(
    source: LayoutSignature, s: Region, dest: LayoutSignature, d: Region, heads: Span | None
) -> list[SlicePair]:
    if heads is None:
        return []
    _, head_dim, state_size = source.ssm_state_shape
    head_bytes = head_dim * state_size * DTYPE_BYTES[source.ssm_dtype]
    src_start = (heads[0] - source.mamba_heads[0]) * head_bytes
    dst_start = (heads[0] - dest.mamba_heads[0]) * head_bytes
    return [_contiguous(s, src_start, d, dst_start, (heads[1] - heads[0]) * head_bytes)]


def _conv_pairs(
    source: LayoutSignature,
    s: Region,
    dest: LayoutSignature,
    d: Region,
    take: Mapping[str, Span | None],
) -> list[SlicePair]:
    """The x, B and C sections' channels of the heads and groups taken."""
    _, head_dim, state_size = source.ssm_state_shape
    channel_bytes = source.conv_state_shape[1] * DTYPE_BYTES[source.conv_dtype]
    pairs = []
    for section in _conv_sections(source, dest, head_dim, state_size):
        taken = take[section.kind]
        if taken is None:
            continue
        src_start = section.src_base + (taken[0] - section.src_first) * section.width
        dst_start = section.dst_base + (taken[0] - section.dst_first) * section.width
        length = (taken[1] - taken[0]) * section.width * channel_bytes
        pairs.append(
            _contiguous(s, src_start * channel_bytes, d, dst_start * channel_bytes, length)
        )
    return pairs


class _Section(NamedTuple):
    kind: str  # "mamba_heads" (x) or "mamba_groups" (B, C)
    width: int  # channels per head or group
    src_base: int  # first channel of the section on each side
    src_first: int  # first head or group each side holds
    dst_base: int
    dst_first: int


def _conv_sections(
    source: LayoutSignature, dest: LayoutSignature, head_dim: int, state_size: int
) -> list[_Section]:
    def bases(signature: LayoutSignature) -> tuple[int, int, int]:
        x = (signature.mamba_heads[1] - signature.mamba_heads[0]) * head_dim
        groups = (signature.mamba_groups[1] - signature.mamba_groups[0]) * state_size
        return 0, x, x + groups

    src, dst = bases(source), bases(dest)
    heads, groups = "mamba_heads", "mamba_groups"
    return [
        _Section(heads, head_dim, src[0], source.mamba_heads[0], dst[0], dest.mamba_heads[0]),
        _Section(groups, state_size, src[1], source.mamba_groups[0], dst[1], dest.mamba_groups[0]),
        _Section(groups, state_size, src[2], source.mamba_groups[0], dst[2], dest.mamba_groups[0]),
    ]


def _merge(pairs: list[SlicePair]) -> list[SlicePair]:
    """Join pairs that continue each other on both sides; rows whole on both
    sides become one contiguous range."""
    merged: list[SlicePair] = []
    for p in pairs:
        joined = _joined(merged[-1], p) if merged else None
        if joined is None:
            merged.append(p)
        else:
            merged[-1] = joined
    return [_flatten(p) for p in merged]


def _whole(p: SlicePair) -> bool:
    return p.num_runs == 1 or p.run == p.src_stride == p.dst_stride


def _joined(last: SlicePair, p: SlicePair) -> SlicePair | None:
    """`last` and `p` as one pair, or None if they do not continue each other."""
    if last.src_buffer != p.src_buffer or last.dst_buffer != p.dst_buffer:
        return None
    if _whole(last) and _whole(p):
        n = last.num_bytes
        if last.src_offset + n != p.src_offset or last.dst_offset + n != p.dst_offset:
            return None
        n += p.num_bytes
        return last._replace(run=n, num_runs=1, src_stride=n, dst_stride=n)
    if (last.run, last.src_stride, last.dst_stride) != (p.run, p.src_stride, p.dst_stride):
        return None
    if (
        last.src_offset + last.num_runs * last.src_stride != p.src_offset
        or last.dst_offset + last.num_runs * last.dst_stride != p.dst_offset
    ):
        return None
    return last._replace(num_runs=last.num_runs + p.num_runs)


def _flatten(p: SlicePair) -> SlicePair:
    if p.num_runs > 1 and p.run == p.src_stride == p.dst_stride:
        length = p.run * p.num_runs
        return p._replace(run=length, num_runs=1, src_stride=length, dst_stride=length)
    return p
