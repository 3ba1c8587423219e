"""Transfer plans: which source bytes land at which destination bytes.

Both managers describe a request as segments keyed by what they hold:
`(attention ordinal, logical block)` -> one KV segment of per-head pieces
`[2, block_size, head_dim]`, `(mamba ordinal, "conv" | "ssm")` -> one state
segment. Pieces and state segments are laid out identically in V1 and V2;
only their addresses differ. Pairing them by key therefore bridges V1 and
V2, and merging runs that are contiguous on both sides turns V2 -> V2 into
one range per run of adjacent blocks (V1 -> V1: one range per layer and run
of adjacent blocks):

    src  |B3: h0L0 h0L1 h1L0 h1L1|B4: ...|   (V2: block-major, head-outer)
    dst  |B7: h0L0 h0L1 h1L0 h1L1|B8: ...|   -> one range
    dst  |L0: B7h0 B7h1 B8h0 ...|L1: ...|    (V1) -> a range per piece

Between two alike layouts (same manager, model and block size) the block
descriptors themselves pair up by position. Plans work on arrays of offsets,
never on an object per segment or piece: a long prompt of a deep model has
tens of thousands of segments.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcache.layout import Region, RequestRegions
from transfer.errors import LayoutMismatch
from transfer.region_arrays import EMPTY, RegionArrays, kv_offsets, strided_arrays

RegionPair = tuple[Region, Region]


def plan_ranges(request_id: str, src: RequestRegions, dst: RequestRegions) -> list[RegionPair]:
    """Pair every source KV piece and Mamba segment with the destination's of
    the same key, merging runs contiguous on both sides; ordered by source
    address.

    Raises `LayoutMismatch` if the key sets or any segment lengths differ (the
    destination allocated a different number of blocks, or the layouts disagree
    on block size, heads, head dim, dtype or Mamba shapes).
    """
    heads = _kv_heads(request_id, src)
    if _same_kv_layout(src, dst):
        _check_kv(request_id, src, dst, (heads, heads))
        kv = _block_ranges(src, dst)
    else:
        kv = [
            _range_pair(*piece)
            for piece in kv_piece_runs(
                request_id, src, dst, (0, heads), (0, 0), (heads, heads)
            ).pairs()
        ]
    return sorted([*kv, *_mamba_ranges(request_id, src, dst)], key=lambda p: _by_address(p[0]))


def _same_kv_layout(src: RequestRegions, dst: RequestRegions) -> bool:
    """Whether both sides lay out a block's KV alike (same manager, model and
    block size): their block descriptors then pair by position, byte for
    byte, and no per-head piece need be listed."""
    return (
        src.kv_layers == dst.kv_layers
        and src.block_descriptors == dst.block_descriptors
        and (src.kv_head_bytes, src.kv_head_stride) == (dst.kv_head_bytes, dst.kv_head_stride)
    )


def _block_ranges(src: RequestRegions, dst: RequestRegions) -> list[RegionPair]:
    """The KV block descriptors of equal layouts paired by position, merged
    where contiguous on both sides (one range per run of blocks adjacent on
    both), with array operations."""
    a = strided_arrays(src.block_descriptors, src.block_ids, ())
    b = strided_arrays(dst.block_descriptors, dst.block_ids, ())
    runs = _merge_runs(
        a.names + b.names, a.codes, a.offsets, b.codes + len(a.names), b.offsets, a.lengths
    )
    return [_range_pair(*run) for run in runs.pairs()]


PiecePair = tuple[str, int, str, int, int]  # src buffer, src offset, dst buffer, dst offset, length


def kv_piece_runs(
    request_id: str,
    src: RequestRegions,
    dst: RequestRegions,
    heads: tuple[int, int],
    firsts: tuple[int, int],
    counts: tuple[int, int],
) -> Runs:
    """The pieces of heads `[heads[0], heads[1])` of every KV segment, source
    to destination, merged where contiguous on both sides, by source address.

    Head `h` is piece `h - firsts[0]` of a source segment and `h - firsts[1]`
    of its destination; the sides' segments hold `counts` heads. In V2 the
    pieces of a head range of a block lie next to each other through all
    layers, so a block's share is one pair (and so is a run of blocks that
    are consecutive on both sides). The pieces are expanded and merged with
    array operations: no object per piece. Where a dimension is contiguous
    on both sides it is not expanded: a segment's heads side by side (V1)
    are one piece, a head's layers side by side (V2) are one piece per
    block (a 32,768-token prompt of a 32-layer model: 65,536 or 8,192
    pieces where there were 262,144).
    """
    _check_kv(request_id, src, dst, counts)
    if not src.num_kv_segments or heads[0] >= heads[1]:
        return Runs([], EMPTY, EMPTY, EMPTY, EMPTY, EMPTY)
    src_buffers, src_offsets = kv_offsets(src)
    dst_buffers, dst_offsets = kv_offsets(dst)
    piece = src.kv_head_bytes
    if _layers_adjacent(src) and _layers_adjacent(dst):
        # Layer k's piece of a head follows layer k - 1's: one piece spans them all.
        src_buffers, src_offsets = src_buffers[:1], src_offsets[:1]
        dst_buffers, dst_offsets = dst_buffers[:1], dst_offsets[:1]
        piece *= len(src.kv_layers)
    step = np.arange(heads[0], heads[1], dtype=np.int64)
    if src.kv_head_stride == dst.kv_head_stride == src.kv_head_bytes:
        # Head h's piece follows head h - 1's: the heads taken are one piece.
        piece *= step.size
        step = step[:1]
    names = sorted({*src_buffers, *dst_buffers})
    per_row = src_offsets.shape[1] * step.size
    src_at = (src_offsets.reshape(-1, 1) + (step - firsts[0]) * src.kv_head_stride).ravel()
    dst_at = (dst_offsets.reshape(-1, 1) + (step - firsts[1]) * dst.kv_head_stride).ravel()
    src_buf = np.repeat(_codes(src_buffers, names), per_row)
    dst_buf = np.repeat(_codes(dst_buffers, names), per_row)
    lengths = np.full(src_at.size, piece, dtype=np.int64)
    return _merge_runs(names, src_buf, src_at, dst_buf, dst_at, lengths)


def _layers_adjacent(regions: RequestRegions) -> bool:
    """Whether every attention layer's piece of a head sits right after the
    previous layer's, in one buffer at one stride (V2's block-major layout)."""
    layers = regions.kv_layers
    first = layers[0]
    return all(
        (layer.buffer, layer.stride, layer.offset)
        == (first.buffer, first.stride, first.offset + k * regions.kv_head_bytes)
        for k, layer in enumerate(layers)
    )


@dataclass(frozen=True)
class Runs:
    """Runs `src -> dst` as columns, by source address: run `i` is
    `length[i]` bytes from `src_at[i]` of buffer `names[src_code[i]]` to
    `dst_at[i]` of `names[dst_code[i]]`."""

    names: Sequence[str]
    src_code: np.ndarray
    src_at: np.ndarray
    dst_code: np.ndarray
    dst_at: np.ndarray
    length: np.ndarray

    def pairs(self) -> list[PiecePair]:
        return [
            (self.names[sc], so, self.names[dc], do, n)
            for sc, so, dc, do, n in zip(
                self.src_code.tolist(),
                self.src_at.tolist(),
                self.dst_code.tolist(),
                self.dst_at.tolist(),
                self.length.tolist(),
                strict=True,
            )
        ]


def _merge_runs(
    names: Sequence[str],
    src_code: np.ndarray,
    src_at: np.ndarray,
    dst_code: np.ndarray,
    dst_at: np.ndarray,
    length: np.ndarray,
) -> Runs:
    """Pieces `src -> dst` of `length` bytes (buffers `names[..._code]`) by
    source address, pieces that continue each other on both sides merged
    into one run."""
    if not src_at.size:
        return Runs(names, EMPTY, EMPTY, EMPTY, EMPTY, EMPTY)
    order = np.lexsort((src_at, src_code))
    src_code, src_at, dst_code, dst_at = (
        src_code[order],
        src_at[order],
        dst_code[order],
        dst_at[order],
    )
    length = length[order]
    continues = (
        (src_code[1:] == src_code[:-1])
        & (dst_code[1:] == dst_code[:-1])
        & (src_at[1:] == src_at[:-1] + length[:-1])
        & (dst_at[1:] == dst_at[:-1] + length[:-1])
    )
    starts = np.concatenate(([0], np.flatnonzero(~continues) + 1))
    return Runs(
        names,
        src_code[starts],
        src_at[starts],
        dst_code[starts],
        dst_at[starts],
        np.add.reduceat(length, starts),
    )


def _codes(buffers: list[str], names: list[str]) -> np.ndarray:
    if len(names) == 1:
        return np.zeros(len(buffers), dtype=np.int64)
    code = {name: i for i, name in enumerate(names)}
    return np.array([code[b] for b in buffers], dtype=np.int64)


def _kv_heads(request_id: str, regions: RequestRegions) -> int:
    """Heads per KV segment, as the spans say."""
    if not regions.num_kv_segments:
        return 0
    span = regions.kv_layers[0].length
    return (span - regions.kv_head_bytes) // max(regions.kv_head_stride, 1) + 1


def _check_kv(
    request_id: str, src: RequestRegions, dst: RequestRegions, counts: tuple[int, int]
) -> None:
    check_same_kv_keys(request_id, src, dst)
    if src.num_kv_segments and src.kv_head_bytes != dst.kv_head_bytes:
        raise LayoutMismatch(
            request_id,
            ["kv_segments"],
            f"a KV head's piece is {src.kv_head_bytes} bytes on the source, "
            f"{dst.kv_head_bytes} here",
        )
    for side, regions, count in (("source", src, counts[0]), ("destination", dst, counts[1])):
        span = (count - 1) * regions.kv_head_stride + regions.kv_head_bytes
        for k, layer in enumerate(regions.kv_layers):
            if regions.block_ids and layer.length != span:
                raise LayoutMismatch(
                    request_id,
                    ["kv_segments"],
                    f"segment {(k, 0)} on the {side} spans {layer.length} "
                    f"bytes where {count} heads span {span}",
                )


def check_same_kv_keys(request_id: str, src: RequestRegions, dst: RequestRegions) -> None:
    """`LayoutMismatch` unless both sides list the same (ordinal, block) KV
    segments: as many attention ordinals and as many blocks."""
    shapes = [(len(r.kv_layers), len(r.block_ids)) for r in (src, dst)]
    if shapes[0] != shapes[1]:
        common = min(shapes[0][0], shapes[1][0]) * min(shapes[0][1], shapes[1][1])
        missing = shapes[0][0] * shapes[0][1] - common
        extra = shapes[1][0] * shapes[1][1] - common
        raise LayoutMismatch(
            request_id,
            ["kv_segments"],
            f"the destination lacks {missing} and has {extra} extra segments; "
            f"allocate as many blocks (and a Mamba slot) as the source holds",
        )


def _check_same_keys(
    request_id: str, name: str, src_map: Mapping[Any, Region], dst_map: Mapping[Any, Region]
) -> None:
    # Key views compare as sets without building any.
    if src_map.keys() != dst_map.keys():
        missing = len(src_map.keys() - dst_map.keys())
        extra = len(dst_map.keys() - src_map.keys())
        raise LayoutMismatch(
            request_id,
            [name],
            f"the destination lacks {missing} and has {extra} extra segments; "
            f"allocate as many blocks (and a Mamba slot) as the source holds",
        )


def _by_address(region: Region) -> tuple[str, int]:
    return region.buffer, region.offset


def _mamba_ranges(request_id: str, src: RequestRegions, dst: RequestRegions) -> list[RegionPair]:
    """Mamba segments paired by key, merged where contiguous on both sides."""
    _check_same_keys(request_id, "mamba_segments", src.mamba_segments, dst.mamba_segments)
    merged: list[RegionPair] = []
    for key, s in sorted(src.mamba_segments.items(), key=lambda item: _by_address(item[1])):
        d = dst.mamba_segments[key]
        if s.length != d.length:
            raise LayoutMismatch(
                request_id,
                ["mamba_segments"],
                f"segment {key} is {s.length} bytes on the source, {d.length} here",
            )
        if merged:
            last_s, last_d = merged[-1]
            if (last_s.buffer, last_s.end, last_d.buffer, last_d.end) == (
                s.buffer,
                s.offset,
                d.buffer,
                d.offset,
            ):
                merged[-1] = _range_pair(
                    s.buffer, last_s.offset, d.buffer, last_d.offset, last_s.length + s.length
                )
                continue
        merged.append((s, d))
    return merged


def _range_pair(
    src_buffer: str, src_offset: int, dst_buffer: str, dst_offset: int, length: int
) -> RegionPair:
    return Region(src_buffer, src_offset, length), Region(dst_buffer, dst_offset, length)


class Coverage:
    """The byte ranges a holder published for one request, for bounds checks."""

    def __init__(self, regions: RegionArrays | Iterable[Region]) -> None:
        arrays = regions if isinstance(regions, RegionArrays) else RegionArrays.of(regions)
        self._starts: dict[str, list[int]] = {}
        self._ends: dict[str, list[int]] = {}
        for code, name in enumerate(arrays.names):
            mine = arrays.codes == code
            offsets, ends = arrays.offsets[mine], arrays.offsets[mine] + arrays.lengths[mine]
            order = np.argsort(offsets, kind="stable")
            offsets, ends = offsets[order], np.maximum.accumulate(ends[order])
            # A run starts where a region begins past every earlier one's end.
            first = np.concatenate(([True], offsets[1:] > ends[:-1]))
            last = np.concatenate((first[1:], [True]))
            self._starts[name] = offsets[first].tolist()
            self._ends[name] = ends[last].tolist()

    def covers(self, buffer: str, offset: int, length: int) -> bool:
        """True if `[offset, offset + length)` of `buffer` lies inside one published run."""
        starts = self._starts.get(buffer)
        if not starts or length <= 0 or offset < 0:
            return False
        i = bisect.bisect_right(starts, offset) - 1
        if i < 0:
            return False
        return starts[i] <= offset and offset + length <= self._ends[buffer][i]


def check_bounds(
    request_id: str, regions: RegionArrays | Iterable[Region], sizes: Mapping[str, int]
) -> None:
    """Raise `LayoutMismatch` if a region names an unknown buffer or runs past its end."""
    arrays = regions if isinstance(regions, RegionArrays) else RegionArrays.of(regions)
    limit = np.array([sizes.get(name, -1) for name in arrays.names], dtype=np.int64)
    ends = arrays.offsets + arrays.lengths
    outside = (arrays.offsets < 0) | (ends > limit[arrays.codes])
    wrong = np.flatnonzero(outside)
    if wrong.size:
        r = arrays.region(int(wrong[0]))
        raise LayoutMismatch(
            request_id,
            ["buffers"],
            f"region {r.buffer}[{r.offset}:{r.offset + r.length}] is outside the "
            f"registered buffers {dict(sizes)}",
        )
