"""Transfer plans: which source bytes land at which destination bytes.

Both managers describe a request as segments keyed by what they hold:
`(attention ordinal, logical block)` -> one `[2, kv_heads, block_size,
head_dim]` KV segment, `(mamba ordinal, "conv" | "ssm")` -> one state segment.
Segment *contents* are laid out identically in V1 and V2; only their
addresses differ. Pairing segments by key therefore bridges V1 and V2, and
merging runs that are contiguous on both sides turns V2 -> V2 into one range
per block (V1 -> V1: one range per layer and run of adjacent blocks):

    src  |L0B3|L1B3|L0B4|L1B4|        (V2: block-major)
    dst  |L0B7|L1B7|L0B8|L1B8|        -> one range of 4 segments
    dst  |L0B7|L0B8| ... |L1B7|L1B8|  (V1) -> four ranges

The plan is pure Python over `Region`s.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from typing import Any

from kvcache.layout import Region, RequestRegions
from transfer.errors import LayoutMismatch

RegionPair = tuple[Region, Region]


def plan_ranges(request_id: str, src: RequestRegions, dst: RequestRegions) -> list[RegionPair]:
    """Pair every source segment with the destination segment of the same key,
    merging runs contiguous on both sides; ordered by source address.

    Raises `LayoutMismatch` if the key sets or any segment lengths differ (the
    destination allocated a different number of blocks, or the layouts disagree
    on block size, heads, head dim, dtype or Mamba shapes).

    A 256 MiB request is thousands of segments but usually a handful of
    ranges, so nothing the garbage collector tracks is made per segment (only
    ints in flat lists): objects per segment would start collections in the
    middle of a transfer. A `Region` is made per merged range.
    """
    merged: list[RegionPair] = []
    by_source = _pair_by_source_buffer(request_id, src, dst)
    for buffer in sorted(by_source):
        offsets, sources, dests = by_source[buffer]
        start = end = dst_start = dst_end = -1
        dst_buffer = ""
        for i in sorted(range(len(offsets)), key=offsets.__getitem__):
            s, d = sources[i], dests[i]
            if s.offset == end and d.buffer == dst_buffer and d.offset == dst_end:
                end += s.length
                dst_end += s.length
                continue
            if start >= 0:
                merged.append(_range_pair(buffer, start, dst_buffer, dst_start, end - start))
            start, end, dst_buffer, dst_start, dst_end = s.offset, s.end, d.buffer, d.offset, d.end
        if start >= 0:
            merged.append(_range_pair(buffer, start, dst_buffer, dst_start, end - start))
    return merged


_Paired = tuple[list[int], list[Region], list[Region]]  # source offsets, sources, destinations


def _pair_by_source_buffer(
    request_id: str, src: RequestRegions, dst: RequestRegions
) -> dict[str, _Paired]:
    """Source buffer -> its segments and their destinations, in parallel lists."""
    maps: list[tuple[str, Mapping[Any, Region], Mapping[Any, Region]]] = [
        ("kv_segments", src.kv_segments, dst.kv_segments),
        ("mamba_segments", src.mamba_segments, dst.mamba_segments),
    ]
    by_source: dict[str, _Paired] = {}
    for name, src_map, dst_map in maps:
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
        for key, s in src_map.items():
            d = dst_map[key]
            if s.length != d.length:
                raise LayoutMismatch(
                    request_id,
                    [name],
                    f"segment {key} is {s.length} bytes on the source, {d.length} here",
                )
            paired = by_source.get(s.buffer)
            if paired is None:
                paired = by_source[s.buffer] = ([], [], [])
            paired[0].append(s.offset)
            paired[1].append(s)
            paired[2].append(d)
    return by_source


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
