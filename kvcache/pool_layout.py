"""The two memory layouts of the cache pools, as byte arithmetic.

V1, layer-major: one buffer per attention layer and one per Mamba layer and kind.

    kv.{l}    [num_blocks][kv_heads][2][block_size][head_dim]      (cache dtype)
    conv.{m}  [num_slots][conv_dim][conv_kernel - 1]               (cache dtype)
    ssm.{m}   [num_slots][num_heads][head_dim][state_size]         (float32)

V2, block-major and head-outer: one buffer for all KV, one for all Mamba state.

    kv        [num_blocks][kv_heads][num_attn_layers][2][block_size][head_dim]
    mamba     [num_slots] x ( ssm_0 | conv_0 | ssm_1 | conv_1 | ... | pad )

A KV *piece* is one head's keys then values of one layer's block,
`[2][block_size][head_dim]`, contiguous; a KV segment (one layer's block) is
its `kv_heads` pieces, next to each other in V1 and `num_attn_layers` pieces
apart in V2:

    V2 block  |h0: L0 L1 L2 L3|h1: L0 L1 L2 L3|h2: ...|h3: ...|
              ^ a range of heads of a block, all layers: one run

So a rank of another tensor parallelism reads its heads of a V2 block as one
run (`transfer.head_slices`), of a V1 block one run per layer. Models see the
usual `[num_blocks, block_size, kv_heads, head_dim]` through strided views
(`kvcache.tensors`).

In V2 a block (every layer's KV) and a slot (every layer's state) are each one
contiguous range. Within a V2 slot each piece starts on a 16-byte boundary so a
float32 SSM view can sit next to a bf16 conv view in one byte buffer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvcache.dtypes import DTYPE_BYTES
from kvcache.layout import (
    CONV,
    KV_HEAD_OUTER,
    MAMBA_KINDS,
    SSM,
    LayoutSignature,
    Region,
    RequestRegions,
    Strided,
    TensorPlacement,
)
from kvcache.mamba_pool import SSM_DTYPE, mamba_state_shape
from kvcache.spec import CacheSpec

ALIGN_BYTES = 16


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


class CacheLayout(ABC):
    """Byte layout of a manager's pools: `num_blocks` KV blocks (incl. the null
    block) and `num_slots` Mamba slots of model `spec`."""

    manager: str

    def __init__(self, spec: CacheSpec, block_size: int, num_blocks: int, num_slots: int) -> None:
        self.spec = spec
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_slots = num_slots if spec.is_hybrid else 0
        self.kv_segment_bytes = spec.kv_bytes_per_block_per_layer(block_size)
        self.kv_head_bytes = self.kv_segment_bytes // spec.num_kv_heads
        self.kv_segment_shape = (spec.num_kv_heads, 2, block_size, spec.head_dim)

    @property
    @abstractmethod
    def kv_head_stride(self) -> int:
        """Bytes from one head's piece of a KV segment to the next head's."""

    def _attention(self, buffer: str, offset: int, stride: int) -> TensorPlacement:
        item = DTYPE_BYTES[self.spec.dtype]
        half = self.block_size * self.spec.head_dim * item
        heads = self.spec.num_kv_heads
        return TensorPlacement(
            buffer=buffer,
            offset=offset,
            stride=stride,
            dtype=self.spec.dtype,
            shape=self.kv_segment_shape,
            item_bytes=(heads - 1) * self.kv_head_stride + self.kv_head_bytes,
            item_strides=(self.kv_head_stride, half, self.spec.head_dim * item, item),
        )

    @abstractmethod
    def buffers(self) -> dict[str, int]:
        """Raw buffer name -> size in bytes."""

    @abstractmethod
    def attention_placement(self, ordinal: int) -> TensorPlacement:
        """Where attention layer `ordinal`'s `[heads, 2, bs, dim]` blocks sit."""

    @abstractmethod
    def mamba_placement(self, ordinal: int, kind: str) -> TensorPlacement:
        """Where Mamba layer `ordinal`'s `kind` ("conv"|"ssm") state per slot sits."""

    @abstractmethod
    def block_descriptors(self) -> tuple[Strided, ...]:
        """The coarse contiguous regions of a block: for each entry, one per block."""

    @abstractmethod
    def slot_descriptors(self, slot: int) -> tuple[Region, ...]:
        """The coarse contiguous regions of Mamba slot `slot` (none for dense models)."""

    def descriptors(self, block_ids: Sequence[int], slot: int | None) -> tuple[Region, ...]:
        """Coarse contiguous regions covering these blocks and this slot."""
        return self.request_regions(block_ids, slot).descriptors

    def mamba_state(self, kind: str) -> tuple[str, tuple[int, ...], int]:
        """(dtype, shape, bytes) of one Mamba layer's `kind` state in one slot."""
        state = mamba_state_shape(self.spec, kind)
        return state.dtype, state.shape, state.num_bytes

    def signature(self) -> LayoutSignature:
        spec = self.spec
        return LayoutSignature.sharded(
            spec.heads,
            manager=self.manager,
            dtype=spec.dtype,
            block_size=self.block_size,
            kv_order=KV_HEAD_OUTER,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            attention_layers=spec.attention_layers,
            mamba_layers=spec.mamba_layers,
            conv_state_shape=spec.conv_state_shape,
            conv_dtype=spec.dtype if spec.is_hybrid else "",
            ssm_state_shape=spec.ssm_state_shape,
            ssm_dtype=SSM_DTYPE if spec.is_hybrid else "",
        )

    def request_regions(self, block_ids: Sequence[int], slot: int | None) -> RequestRegions:
        attention = [self.attention_placement(k) for k in range(self.spec.num_attention_layers)]
        mamba_segments: dict[tuple[int, str], Region] = {}
        if slot is not None:
            for m in range(len(self.spec.mamba_layers)):
                for kind in MAMBA_KINDS:
                    mamba_segments[(m, kind)] = self.mamba_placement(m, kind).region(slot)
        return RequestRegions(
            block_ids=tuple(block_ids),
            mamba_slot=slot,
            kv_layers=tuple(_strided(p) for p in attention),
            mamba_segments=mamba_segments,
            block_descriptors=self.block_descriptors(),
            slot_descriptors=self.slot_descriptors(slot) if slot is not None else (),
            kv_head_bytes=self.kv_head_bytes,
            kv_head_stride=self.kv_head_stride,
        )


def _strided(placement: TensorPlacement) -> Strided:
    return Strided(placement.buffer, placement.offset, placement.stride, placement.item_bytes)


class LayerMajorLayout(CacheLayout):
    """V1: a buffer per attention layer, a buffer per Mamba layer and kind."""

    manager = "v1"

    def buffers(self) -> dict[str, int]:
        sizes = {
            f"kv.{k}": self.num_blocks * self.kv_segment_bytes
            for k in range(self.spec.num_attention_layers)
        }
        for m in range(len(self.spec.mamba_layers)):
            for kind in MAMBA_KINDS:
                sizes[f"{kind}.{m}"] = self.num_slots * self.mamba_state(kind)[2]
        return sizes

    @property
    def kv_head_stride(self) -> int:
        return self.kv_head_bytes

    def attention_placement(self, ordinal: int) -> TensorPlacement:
        return self._attention(f"kv.{ordinal}", 0, self.kv_segment_bytes)

    def mamba_placement(self, ordinal: int, kind: str) -> TensorPlacement:
        dtype, shape, nbytes = self.mamba_state(kind)
        return TensorPlacement(f"{kind}.{ordinal}", 0, nbytes, dtype, shape, nbytes)

    def block_descriptors(self) -> tuple[Strided, ...]:
        """A block's segment of each layer (layer-major: every block of layer 0 first)."""
        return tuple(
            _strided(self.attention_placement(k)) for k in range(self.spec.num_attention_layers)
        )

    def slot_descriptors(self, slot: int) -> tuple[Region, ...]:
        return tuple(
            self.mamba_placement(m, kind).region(slot)
            for m in range(len(self.spec.mamba_layers))
            for kind in MAMBA_KINDS
        )


class BlockMajorLayout(CacheLayout):
    """V2: one buffer "kv" of whole blocks, one buffer "mamba" of whole slots."""

    manager = "v2"

    def __init__(self, spec: CacheSpec, block_size: int, num_blocks: int, num_slots: int) -> None:
        super().__init__(spec, block_size, num_blocks, num_slots)
        self.block_bytes = spec.num_attention_layers * self.kv_segment_bytes
        self.slot_bytes, self._slot_offsets = block_major_slot_layout(spec)

    def buffers(self) -> dict[str, int]:
        sizes = {"kv": self.num_blocks * self.block_bytes}
        if self.spec.is_hybrid:
            sizes["mamba"] = self.num_slots * self.slot_bytes
        return sizes

    @property
    def kv_head_stride(self) -> int:
        return self.spec.num_attention_layers * self.kv_head_bytes

    def attention_placement(self, ordinal: int) -> TensorPlacement:
        return self._attention("kv", ordinal * self.kv_head_bytes, self.block_bytes)

    def mamba_placement(self, ordinal: int, kind: str) -> TensorPlacement:
        dtype, shape, nbytes = self.mamba_state(kind)
        offset = self._slot_offsets[(ordinal, kind)]
        return TensorPlacement("mamba", offset, self.slot_bytes, dtype, shape, nbytes)

    def block_descriptors(self) -> tuple[Strided, ...]:
        """A whole block, every layer."""
        return (Strided("kv", 0, self.block_bytes, self.block_bytes),)

    def slot_descriptors(self, slot: int) -> tuple[Region, ...]:
        if not self.spec.is_hybrid:
            return ()
        return (Region("mamba", slot * self.slot_bytes, self.slot_bytes),)


def block_major_slot_layout(spec: CacheSpec) -> tuple[int, dict[tuple[int, str], int]]:
    """(bytes per V2 Mamba slot, byte offset of each (ordinal, kind) in a slot)."""
    offsets: dict[tuple[int, str], int] = {}
    cursor = 0
    for m in range(len(spec.mamba_layers)):
        # SSM (float32) first, then conv; every piece starts 16-byte aligned.
        for kind, nbytes in ((SSM, spec.ssm_state_bytes), (CONV, spec.conv_state_bytes)):
            offsets[(m, kind)] = cursor
            cursor = _align(cursor + nbytes)
    return cursor, offsets


def layout_for(
    manager: str, spec: CacheSpec, block_size: int, num_blocks: int, num_slots: int
) -> CacheLayout:
    """The layout of manager `manager` ("v1" or "v2")."""
    if manager == LayerMajorLayout.manager:
        return LayerMajorLayout(spec, block_size, num_blocks, num_slots)
    if manager == BlockMajorLayout.manager:
        return BlockMajorLayout(spec, block_size, num_blocks, num_slots)
    raise ValueError(f"unknown KV cache manager {manager!r}; use 'v1' or 'v2'")
