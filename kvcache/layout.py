"""Where a request's cache lives in memory, independent of torch.

A worker registers a few named raw buffers (the pool tensors) with its
transceiver. A `Region` is a byte range of one such buffer; `RequestRegions`
says where one request's cache lies (its block table and, per layer, a
`Strided` rule from block id to region) and lists its regions at two
granularities, built on first use:

- segments: one per (attention ordinal, logical block) and per (Mamba ordinal,
  "conv"|"ssm"). A KV segment is `kv_heads` *pieces*, one per head, each
  `[2, block_size, head_dim]` (the head's keys then values) and contiguous,
  `kv_head_stride` bytes apart: next to each other in V1, one whole block's
  layers apart in V2 (`kvcache.pool_layout`). Pieces are alike in both
  managers, so a transceiver moves them between a V1 and a V2 worker one for
  one, and a range of KV heads of a V2 block is one contiguous run.
- descriptors: the coarsest contiguous ranges, for NIXL. V2: one per block and
  one per Mamba slot. V1: one per (layer, block) and per Mamba (layer, kind).

`LayoutSignature` says what the bytes mean; both sides compare signatures
before any byte moves.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, NamedTuple

from kvcache.spec import HeadShard

CONV = "conv"
SSM = "ssm"
MAMBA_KINDS = (CONV, SSM)

# The order of a KV segment's dims, as `LayoutSignature.kv_order` names it.
# Both managers write head-outer segments (per head its keys, then its values);
# token-major (`[2, block_size, kv_heads, head_dim]`) is what a signature
# without the field meant and head-major (`[2, kv_heads, block_size,
# head_dim]`) what the previous layout wrote, so a peer with either is refused,
# not misread.
KV_HEAD_OUTER = "head_outer"
KV_HEAD_MAJOR = "head_major"
KV_TOKEN_MAJOR = "token_major"


class Region(NamedTuple):
    """`length` bytes at byte `offset` of the buffer registered as `buffer`.

    A named tuple, not a dataclass: a request's regions number in the
    thousands and travel in every transfer handle, and a tuple builds,
    pickles and unpickles in a fraction of a dataclass's time.
    """

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
    contiguous unless `item_strides` gives each dim's byte stride. For
    attention, `shape` is `[kv_heads, 2, block_size, head_dim]` with the heads
    `head_stride` bytes apart. `region` is the span from an item's first byte
    to its last, `item_bytes` long.
    """

    buffer: str
    offset: int
    stride: int
    dtype: str
    shape: tuple[int, ...]
    item_bytes: int
    item_strides: tuple[int, ...] | None = None

    def region(self, index: int) -> Region:
        return Region(self.buffer, self.offset + index * self.stride, self.item_bytes)


class Strided(NamedTuple):
    """One region per block of a request: block id `b`'s is
    `Region(buffer, offset + b * stride, length)`."""

    buffer: str
    offset: int
    stride: int
    length: int

    def region(self, block_id: int) -> Region:
        return Region(self.buffer, self.offset + block_id * self.stride, self.length)


@dataclass(frozen=True)
class RequestRegions:
    """The cache regions of one request, as a few numbers per layer.

    block_ids: the request's block table, logical block `j` -> physical id.
    mamba_slot: the request's Mamba slot, None for dense models.
    kv_layers: per attention ordinal `k`, where its KV segments lie: the
        segment of logical block `j` is `kv_layers[k].region(block_ids[j])`.
        A segment's pieces (one per head), `kv_head_bytes` each, start
        `kv_head_stride` bytes apart from its first byte (`kv_pieces`). In V2
        a segment also spans other layers' pieces of the same block.
    mamba_segments: (Mamba ordinal, "conv" | "ssm") -> that state of its slot.
    block_descriptors, slot_descriptors: the coarse contiguous regions that
        cover exactly the same bytes (`descriptors`): for each entry of
        `block_descriptors` in turn, one region per block, then the slot's.

    The per-segment views (`kv_segments`, `descriptors`) are built on first
    use and never pickled: a long prompt's request spans tens of thousands of
    segments (a 32,768-token prompt of a 32-layer model, 65,536), which as
    objects took hundreds of milliseconds to build, pickle and unpickle on
    every hop of a transfer handle, while this form is its block table and a
    few numbers per layer. Planners read it as arrays (`transfer.region_arrays`).
    """

    block_ids: tuple[int, ...]
    mamba_slot: int | None
    kv_layers: tuple[Strided, ...]
    mamba_segments: dict[tuple[int, str], Region]
    block_descriptors: tuple[Strided, ...]
    slot_descriptors: tuple[Region, ...]
    kv_head_bytes: int
    kv_head_stride: int

    def __getstate__(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # no cached views

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @functools.cached_property
    def kv_segments(self) -> dict[tuple[int, int], Region]:
        """(attention ordinal, logical block index) -> the span of its KV segment."""
        return {
            (k, j): layer.region(block_id)
            for k, layer in enumerate(self.kv_layers)
            for j, block_id in enumerate(self.block_ids)
        }

    @functools.cached_property
    def descriptors(self) -> tuple[Region, ...]:
        """The coarse contiguous regions, in order (see the class docstring)."""
        per_block = [d.region(b) for d in self.block_descriptors for b in self.block_ids]
        return (*per_block, *self.slot_descriptors)

    @property
    def num_kv_segments(self) -> int:
        return len(self.kv_layers) * len(self.block_ids)

    @property
    def num_bytes(self) -> int:
        per_block = sum(d.length for d in self.block_descriptors)
        return len(self.block_ids) * per_block + sum(r.length for r in self.slot_descriptors)

    def kv_pieces(self, span: Region) -> list[Region]:
        """The contiguous per-head pieces of the KV segment `span`, heads in order."""
        count = (span.length - self.kv_head_bytes) // self.kv_head_stride + 1
        return [
            Region(span.buffer, span.offset + h * self.kv_head_stride, self.kv_head_bytes)
            for h in range(count)
        ]

    def contiguous_segments(self) -> dict[tuple[object, ...], Region]:
        """Every KV piece, keyed (ordinal, block index, head), and every Mamba
        segment, keyed as in `mamba_segments`: contiguous regions, the bytes
        the request holds, each once."""
        out: dict[tuple[object, ...], Region] = {
            (*key, h): piece
            for key, span in self.kv_segments.items()
            for h, piece in enumerate(self.kv_pieces(span))
        }
        out.update({(*key,): region for key, region in self.mamba_segments.items()})
        return out


@dataclass(frozen=True)
class LayoutSignature:
    """Everything that decides what a cache region's bytes mean.

    Two workers may exchange descriptors (NIXL) only when their signatures are
    equal; segment-wise transfer (Python transceiver) needs them equal except
    for `manager`. `kv_order` names the order of a KV segment's dims.

    A rank of a tensor-parallel instance holds some of the model's heads: the
    shapes above are its own, `tp_size`/`tp_rank` say which rank it is and
    the head ranges (`[start, stop)` of the whole model's heads, out of the
    `total_*` counts) which heads its bytes hold. Two ranks of different
    tensor parallelism exchange head slices; what they must agree on is
    `whole()`, the signature the model has on one rank.
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
    kv_order: str = KV_TOKEN_MAJOR
    tp_size: int = 1
    tp_rank: int = 0
    total_kv_heads: int = 0
    kv_heads: tuple[int, ...] = ()
    total_mamba_heads: int = 0
    mamba_heads: tuple[int, ...] = ()
    total_mamba_groups: int = 0
    mamba_groups: tuple[int, ...] = ()

    @classmethod
    def sharded(cls, shard: HeadShard, **values: Any) -> LayoutSignature:
        """A signature whose TP fields say what `shard` holds."""
        return cls(
            **values,
            tp_size=shard.size,
            tp_rank=shard.rank,
            total_kv_heads=shard.total_kv_heads,
            kv_heads=shard.kv_heads,
            total_mamba_heads=shard.total_mamba_heads,
            mamba_heads=shard.mamba_heads,
            total_mamba_groups=shard.total_mamba_groups,
            mamba_groups=shard.mamba_groups,
        )

    def head_shard(self) -> HeadShard:
        """The heads this signature's bytes hold."""
        spans = (self.kv_heads, self.mamba_heads, self.mamba_groups)
        if any(len(span) != 2 for span in spans):
            raise ValueError(f"head ranges must be [start, stop) pairs, got {spans}")
        return HeadShard(
            rank=self.tp_rank,
            size=self.tp_size,
            total_kv_heads=self.total_kv_heads,
            kv_heads=(self.kv_heads[0], self.kv_heads[1]),
            total_mamba_heads=self.total_mamba_heads,
            mamba_heads=(self.mamba_heads[0], self.mamba_heads[1]),
            total_mamba_groups=self.total_mamba_groups,
            mamba_groups=(self.mamba_groups[0], self.mamba_groups[1]),
        )

    def whole(self) -> LayoutSignature:
        """The signature of the same model and layout on one rank (all heads)."""
        conv, ssm = self.conv_state_shape, self.ssm_state_shape
        if self.mamba_layers:
            heads, head_dim, state_size = ssm
            channels = self.total_mamba_heads * head_dim
            conv = (channels + 2 * self.total_mamba_groups * state_size, *conv[1:])
            ssm = (self.total_mamba_heads, head_dim, state_size)
        return replace(
            self,
            num_kv_heads=self.total_kv_heads,
            conv_state_shape=conv,
            ssm_state_shape=ssm,
            tp_size=1,
            tp_rank=0,
            kv_heads=(0, self.total_kv_heads),
            mamba_heads=(0, self.total_mamba_heads),
            mamba_groups=(0, self.total_mamba_groups),
        )

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
