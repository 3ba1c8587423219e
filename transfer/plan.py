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

The plan is pure Python over `Region`s.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from kvcache.layout import Region, RequestRegions
from transfer.errors import LayoutMismatch

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
    kv = [
        _range_pair(*piece)
        for piece in kv_piece_pairs(request_id, src, dst, (0, heads), (0, 0), (heads, heads))
    ]
    return sorted([*kv, *_mamba_ranges(request_id, src, dst)], key=lambda p: _by_address(p[0]))


PiecePair = tuple[str, int, str, int, int]  # src buffer, src offset, dst buffer, dst offset, length


def kv_piece_pairs(
    request_id: str,
    src: RequestRegions,
    dst: RequestRegions,
    heads: tuple[int, int],
    firsts: tuple[int, int],
    counts: tuple[int, int],
) -> list[PiecePair]:
    """The pieces of heads `[heads[0], heads[1])` of every KV segment, source
    to destination, merged where contiguous on both sides, by source address.

    Head `h` is piece `h - firsts[0]` of a source segment and `h - firsts[1]`
    of its destination; the sides' segments hold `counts` heads. In V2 the
    pieces of a head range of a block lie next to each other through all
    layers, so a block's share is one pair (and so is a run of blocks that
    are consecutive on both sides). The pieces are expanded and merged with
    array operations: no object per piece.
    """
    _check_kv(request_id, src, dst, counts)
    if not src.kv_segments or heads[0] >= heads[1]:
        return []
    src_spans = list(src.kv_segments.values())
    dst_spans = list(map(dst.kv_segments.__getitem__, src.kv_segments))
    src_buffers, src_offsets = _columns(src_spans)
    dst_buffers, dst_offsets = _columns(dst_spans)
    names = sorted({*src_buffers, *dst_buffers})
    step = np.arange(heads[0], heads[1], dtype=np.int64)
    src_at = (src_offsets[:, None] + (step - firsts[0]) * src.kv_head_stride).ravel()
    dst_at = (dst_offsets[:, None] + (step - firsts[1]) * dst.kv_head_stride).ravel()
    src_buf = np.repeat(_codes(src_buffers, names), step.size)
    dst_buf = np.repeat(_codes(dst_buffers, names), step.size)
    order = np.lexsort((src_at, src_buf))
    src_at, dst_at, src_buf, dst_buf = src_at[order], dst_at[order], src_buf[order], dst_buf[order]
    piece = src.kv_head_bytes
    continues = (
        (src_buf[1:] == src_buf[:-1])
        & (dst_buf[1:] == dst_buf[:-1])
        & (src_at[1:] == src_at[:-1] + piece)
        & (dst_at[1:] == dst_at[:-1] + piece)
    )
    starts = np.concatenate(([0], np.flatnonzero(~continues) + 1))
    lengths = np.diff(np.concatenate((starts, [src_at.size]))) * piece
    return [
        (names[sb], so, names[db], do, n)
        for sb, so, db, do, n in zip(
            src_buf[starts].tolist(),
            src_at[starts].tolist(),
            dst_buf[starts].tolist(),
            dst_at[starts].tolist(),
            lengths.tolist(),
            strict=True,
        )
    ]


def _columns(spans: list[Region]) -> tuple[list[str], np.ndarray]:
    """Buffer names and offsets of `spans`, as a list of (interned) str and an
    int array: no object the garbage collector tracks per span."""
    return [r.buffer for r in spans], np.array([r.offset for r in spans], dtype=np.int64)


def _codes(buffers: list[str], names: list[str]) -> np.ndarray:
    if len(names) == 1:
        return np.zeros(len(buffers), dtype=np.int64)
    code = {name: i for i, name in enumerate(names)}
    return np.array([code[b] for b in buffers], dtype=np.int64)


def _kv_heads(request_id: str, regions: RequestRegions) -> int:
    """Heads per KV segment, as the spans say."""
    if not regions.kv_segments:
        return 0
    span = next(iter(regions.kv_segments.values()))
    return (span.length - regions.kv_head_bytes) // max(regions.kv_head_stride, 1) + 1


def _check_kv(
    request_id: str, src: RequestRegions, dst: RequestRegions, counts: tuple[int, int]
) -> None:
    _check_same_keys(request_id, "kv_segments", src.kv_segments, dst.kv_segments)
    if src.kv_segments and src.kv_head_bytes != dst.kv_head_bytes:
        raise LayoutMismatch(
            request_id,
            ["kv_segments"],
            f"a KV head's piece is {src.kv_head_bytes} bytes on the source, "
            f"{dst.kv_head_bytes} here",
        )
    for side, regions, count in (("source", src, counts[0]), ("destination", dst, counts[1])):
        span = (count - 1) * regions.kv_head_stride + regions.kv_head_bytes
        lengths = np.array([r.length for r in regions.kv_segments.values()], dtype=np.int64)
        wrong = np.flatnonzero(lengths != span)
        if wrong.size:
            key, region = list(regions.kv_segments.items())[wrong[0]]
            raise LayoutMismatch(
                request_id,
                ["kv_segments"],
                f"segment {key} on the {side} spans {region.length} "
                f"bytes where {count} heads span {span}",
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

    def __init__(self, regions: Iterable[Region]) -> None:
        spans: dict[str, list[tuple[int, int]]] = {}
        for r in sorted(regions, key=lambda r: (r.buffer, r.offset)):
            runs = spans.setdefault(r.buffer, [])
            if runs and runs[-1][1] >= r.offset:
                runs[-1] = (runs[-1][0], max(runs[-1][1], r.offset + r.length))
            else:
                runs.append((r.offset, r.offset + r.length))
        self._starts = {b: [s for s, _ in runs] for b, runs in spans.items()}
        self._runs = spans

    def covers(self, buffer: str, offset: int, length: int) -> bool:
        """True if `[offset, offset + length)` of `buffer` lies inside one published run."""
        starts = self._starts.get(buffer)
        if not starts or length <= 0 or offset < 0:
            return False
        i = bisect.bisect_right(starts, offset) - 1
        if i < 0:
            return False
        start, end = self._runs[buffer][i]
        return start <= offset and offset + length <= end


def segment_regions(regions: RequestRegions) -> list[Region]:
    """Every KV and Mamba segment of a request."""
    return [*regions.kv_segments.values(), *regions.mamba_segments.values()]


def check_bounds(request_id: str, regions: Iterable[Region], sizes: Mapping[str, int]) -> None:
    """Raise `LayoutMismatch` if a region names an unknown buffer or runs past its end."""
    for r in regions:
        size = sizes.get(r.buffer)
        if size is None or r.offset < 0 or r.offset + r.length > size:
            raise LayoutMismatch(
                request_id,
                ["buffers"],
                f"region {r.buffer}[{r.offset}:{r.offset + r.length}] is outside the "
                f"registered buffers {dict(sizes)}",
            )
