"""A request's regions as numpy columns (buffer code, offset, length), built
from its block table and per-layer rules without an object per segment:
what every plan, bounds check and NIXL descriptor list reads."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvcache.layout import Region, RequestRegions, Strided


def kv_offsets(regions: RequestRegions) -> tuple[list[str], np.ndarray]:
    """Each attention ordinal's buffer, and every KV segment's first byte as
    `[ordinals, blocks]` (block `j` of the request's table in column `j`):
    arrays from the per-layer form, no object per segment."""
    layers = regions.kv_layers
    return [layer.buffer for layer in layers], _strided_offsets(layers, regions.block_ids)


def _strided_offsets(strided: Sequence[Strided], block_ids: Sequence[int]) -> np.ndarray:
    """`[len(strided), len(block_ids)]`: where rule `k` puts block `j`."""
    ids = np.asarray(block_ids, dtype=np.int64)
    base = np.array([s.offset for s in strided], dtype=np.int64).reshape(-1, 1)
    stride = np.array([s.stride for s in strided], dtype=np.int64).reshape(-1, 1)
    return base + stride * ids


@dataclass(frozen=True)
class RegionArrays:
    """Regions as columns: region `i` is `length[i]` bytes at `offsets[i]` of
    buffer `names[codes[i]]`."""

    names: list[str]
    codes: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of(cls, regions: Iterable[Region]) -> RegionArrays:
        listed = list(regions)
        names = sorted({r.buffer for r in listed})
        code = {name: i for i, name in enumerate(names)}
        return cls(
            names,
            np.array([code[r.buffer] for r in listed], dtype=np.int64),
            np.array([r.offset for r in listed], dtype=np.int64),
            np.array([r.length for r in listed], dtype=np.int64),
        )

    @classmethod
    def concat(cls, parts: Sequence[RegionArrays]) -> RegionArrays:
        names = sorted({name for part in parts for name in part.names})
        code = {name: i for i, name in enumerate(names)}
        recode = [np.array([code[n] for n in p.names], dtype=np.int64) for p in parts]
        return cls(
            names,
            np.concatenate([r[p.codes] for r, p in zip(recode, parts, strict=True)] or [EMPTY]),
            np.concatenate([p.offsets for p in parts] or [EMPTY]),
            np.concatenate([p.lengths for p in parts] or [EMPTY]),
        )

    def __len__(self) -> int:
        return int(self.offsets.size)

    def region(self, i: int) -> Region:
        return Region(self.names[self.codes[i]], int(self.offsets[i]), int(self.lengths[i]))


EMPTY = np.zeros(0, dtype=np.int64)  # an empty column


def strided_arrays(
    strided: Sequence[Strided], block_ids: Sequence[int], fixed: Iterable[Region]
) -> RegionArrays:
    """Each of `strided` at every block id (all blocks of the first, then of
    the next), then the `fixed` regions."""
    layers = RegionArrays(
        [s.buffer for s in strided],
        np.repeat(np.arange(len(strided), dtype=np.int64), len(block_ids)),
        _strided_offsets(strided, block_ids).ravel(),
        np.repeat(np.array([s.length for s in strided], dtype=np.int64), len(block_ids)),
    )
    return RegionArrays.concat([layers, RegionArrays.of(fixed)])


def segment_arrays(regions: RequestRegions) -> RegionArrays:
    """Every KV segment (ordinal-major) and Mamba segment of a request, as arrays."""
    return strided_arrays(regions.kv_layers, regions.block_ids, regions.mamba_segments.values())


def descriptor_arrays(regions: RequestRegions) -> RegionArrays:
    """`regions.descriptors` as arrays, in the same order."""
    return strided_arrays(regions.block_descriptors, regions.block_ids, regions.slot_descriptors)
