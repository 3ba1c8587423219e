"""Where a request's cache lives in memory, independent of torch.

A worker registers a few named raw buffers (the pool tensors) with its
transceiver. A `Region` is a byte range of one such buffer; `RequestRegions`
lists them for one request at two granularities:

- segments: one per (attention ordinal, logical block) and per (Mamba ordinal,
  "conv"|"ssm"). Every KV segment holds `[2, block_size, kv_heads, head_dim]`
  (keys then values) in both managers, so a transceiver can move segments
  between a V1 and a V2 worker one for one.
- descriptors: the coarsest contiguous ranges, for NIXL. V2: one per block and
  one per Mamba slot. V1: one per (layer, block) and per Mamba (layer, kind).

`LayoutSignature` says what the bytes mean; both sides compare signatures
before any byte moves.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

CONV = "conv"
SSM = "ssm"
MAMBA_KINDS = (CONV, SSM)


@dataclass(frozen=True)
class Region:
    """`length` bytes at byte `offset` of the buffer registered as `buffer`."""

    buffer: str
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class TensorPlacement:
    """How a per-layer cache tensor is strided into a raw buffer.

    Item `i` (a block or a slot) of the tensor starts at byte
    `offset + i * stride` of `buffer` and holds `shape` elements of `dtype`,
    contiguous. For attention, `shape` is `[2, block_size, kv_heads, head_dim]`.
    """

    buffer: str
    offset: int
    stride: int
    dtype: str
    shape: tuple[int, ...]
    item_bytes: int

    def region(self, index: int) -> Region:
        return Region(self.buffer, self.offset + index * self.stride, self.item_bytes)


@dataclass(frozen=True)
class RequestRegions:
    """The cache regions of one request.

    block_ids: the request's block table, logical block `j` -> physical id.
    mamba_slot: the request's Mamba slot, None for dense models.
    kv_segments: (attention ordinal, logical block index) -> its KV segment.
    mamba_segments: (Mamba ordinal, "conv" | "ssm") -> that state of its slot.
    descriptors: coarse contiguous regions covering exactly the same bytes.
    """

    block_ids: tuple[int, ...]
    mamba_slot: int | None
    kv_segments: dict[tuple[int, int], Region]
    mamba_segments: dict[tuple[int, str], Region]
    descriptors: tuple[Region, ...]

    @property
    def num_bytes(self) -> int:
        return sum(region.length for region in self.descriptors)


@dataclass(frozen=True)
class LayoutSignature:
    """Everything that decides what a cache region's bytes mean.

    Two workers may exchange descriptors (NIXL) only when their signatures are
    equal; segment-wise transfer (Python transceiver) needs them equal except
    for `manager`.
    """

    manager: str
    dtype: str
    block_size: int
    num_kv_heads: int
    head_dim: int
    attention_layers: tuple[int, ...]
    mamba_layers: tuple[int, ...] = ()
    conv_state_shape: tuple[int, ...] = ()
    conv_dtype: str = ""
    ssm_state_shape: tuple[int, ...] = ()
    ssm_dtype: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of str/int/list values, safe for msgpack or JSON."""
        return {
            key: list(value) if isinstance(value, tuple) else value
            for key, value in asdict(self).items()
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayoutSignature:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown layout signature fields {sorted(unknown)}")
        values: dict[str, Any] = {
            key: tuple(value) if isinstance(value, list) else value for key, value in data.items()
        }
        return cls(**values)

    def diff(self, other: LayoutSignature, ignore: tuple[str, ...] = ()) -> list[str]:
        """Fields that differ, as "name: mine != theirs"; empty when compatible."""
        return [
            f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
            for f in fields(self)
            if f.name not in ignore and getattr(self, f.name) != getattr(other, f.name)
        ]
