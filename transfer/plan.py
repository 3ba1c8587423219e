"""Transfer plans: which source bytes land at which destination bytes.

Both managers describe a request as segments keyed by what they hold:
`(attention ordinal, logical block)` -> one `[2, block_size, kv_heads,
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


def pair_segments(request_id: str, src: RequestRegions, dst: RequestRegions) -> list[RegionPair]:
    """Match every source segment to the destination segment with the same key.

    Raises `LayoutMismatch` if the key sets or any segment lengths differ (the
    destination allocated a different number of blocks, or the layouts disagree
    on block size, heads, head dim, dtype or Mamba shapes).
    """
    maps: list[tuple[str, Mapping[Any, Region], Mapping[Any, Region]]] = [
        ("kv_segments", src.kv_segments, dst.kv_segments),
        ("mamba_segments", src.mamba_segments, dst.mamba_segments),
    ]
    pairs: list[RegionPair] = []
    for name, src_map, dst_map in maps:
        # Key views compare as sets without building any; no sort here:
        # `coalesce` orders the pairs by source address anyway.
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
            pairs.append((s, d))
    return pairs


def coalesce(pairs: Iterable[RegionPair]) -> list[RegionPair]:
    """Merge pairs whose source and destination both continue the previous pair.

    Pairs are equally long on both sides (as `pair_segments` makes them); the
    result is ordered by source address. The merge runs over plain tuples and
    builds a `Region` only per merged range: a 256 MiB request is thousands of
    segments but usually a handful of ranges.
    """
    rows = sorted((s.buffer, s.offset, d.buffer, d.offset, s.length) for s, d in pairs)
    merged: list[list[Any]] = []
    for src_buffer, src_offset, dst_buffer, dst_offset, length in rows:
        if merged:
            last = merged[-1]
            if (
                last[0] == src_buffer
                and last[2] == dst_buffer
                and last[1] + last[4] == src_offset
                and last[3] + last[4] == dst_offset
            ):
                last[4] += length
                continue
        merged.append([src_buffer, src_offset, dst_buffer, dst_offset, length])
    return [(Region(sb, so, n), Region(db, do, n)) for sb, so, db, do, n in merged]


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
