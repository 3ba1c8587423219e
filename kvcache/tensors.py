"""The pool tensors behind a manager's layout: the only torch code in `kvcache`.

`allocate_cache_tensors` allocates each raw buffer of a layout as one flat
uint8 tensor (the memory a transceiver registers) and builds the per-layer
typed views models write through (`CacheViews`). Every view is an `as_strided`
window into a raw buffer, so a write through a view is visible in the buffer's
bytes and hence in the request's `Region`s.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field

import torch

from kvcache.dtypes import torch_dtype
from kvcache.layout import CONV, SSM, Region, TensorPlacement
from kvcache.manager import KVCacheManager
from kvcache.pool_layout import CacheLayout
from kvcache.views import AttentionLayerCache, CacheViews, MambaLayerCache

_HUGE_PAGE_BYTES = 2 << 20


@dataclass
class CacheTensors:
    """Raw buffers of one layout plus typed views into them."""

    layout: CacheLayout
    raw: dict[str, torch.Tensor]
    _views: CacheViews | None = field(default=None, repr=False)

    def buffers(self) -> dict[str, torch.Tensor]:
        """Buffer name -> flat uint8 tensor; the names `Region.buffer` refers to."""
        return dict(self.raw)

    def views(self) -> CacheViews:
        """Per attention ordinal key/value `[num_blocks, block_size, kv_heads,
        head_dim]` (strided: the memory is head-outer, see `pool_layout`), per
        Mamba ordinal conv/SSM `[num_slots, ...]`."""
        if self._views is None:
            self._views = self._build_views()
        return self._views

    def region_tensor(self, region: Region) -> torch.Tensor:
        """Zero-copy uint8 view of a region's bytes."""
        buffer = self.raw[region.buffer]
        if region.offset < 0 or region.end > buffer.numel():
            raise ValueError(
                f"{region} lies outside buffer {region.buffer!r} of {buffer.numel()} bytes"
            )
        return buffer[region.offset : region.end]

    def read_region(self, region: Region) -> bytes:
        return self.region_tensor(region).cpu().numpy().tobytes()

    def write_region(self, region: Region, data: bytes | bytearray | memoryview) -> None:
        if len(data) != region.length:
            raise ValueError(f"{len(data)} bytes do not fit {region} of {region.length} bytes")
        source = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.region_tensor(region).copy_(source)

    def _build_views(self) -> CacheViews:
        layout = self.layout
        attention = []
        for k in range(layout.spec.num_attention_layers):
            # [blocks, kv_heads, 2, bs, d] in memory (heads strided); models
            # index [block, offset, head].
            kv = self._placed(layout.attention_placement(k), layout.num_blocks)
            keys, values = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
            attention.append(AttentionLayerCache(key_cache=keys, value_cache=values))
        mamba = [
            MambaLayerCache(
                conv_state=self._placed(layout.mamba_placement(m, CONV), layout.num_slots),
                ssm_state=self._placed(layout.mamba_placement(m, SSM), layout.num_slots),
            )
            for m in range(len(layout.spec.mamba_layers))
        ]
        return CacheViews(attention=attention, mamba=mamba)

    def _placed(self, placement: TensorPlacement, count: int) -> torch.Tensor:
        dtype = torch_dtype(placement.dtype)
        typed = self.raw[placement.buffer].view(dtype)
        itemsize = typed.element_size()
        strides = placement.item_strides or ()
        if any(n % itemsize for n in (placement.offset, placement.stride, *strides)):
            raise ValueError(f"{placement} is not aligned to {placement.dtype}")
        if strides:
            inner = [n // itemsize for n in strides]
        else:
            inner = [1]
            for dim in reversed(placement.shape[1:]):
                inner.insert(0, inner[0] * dim)
        return typed.as_strided(
            size=(count, *placement.shape),
            stride=(placement.stride // itemsize, *inner),
            storage_offset=typed.storage_offset() + placement.offset // itemsize,
        )


def allocate_cache_tensors(
    manager_or_layout: KVCacheManager | CacheLayout, device: str | torch.device = "cpu"
) -> CacheTensors:
    """Zero-filled raw buffers for the manager's (or layout's) pools on `device`."""
    layout = (
        manager_or_layout.layout
        if isinstance(manager_or_layout, KVCacheManager)
        else manager_or_layout
    )
    device = torch.device(device)
    raw = {
        name: allocate_host_buffer(num_bytes)
        if device.type == "cpu"
        else torch.zeros(num_bytes, dtype=torch.uint8, device=device)
        for name, num_bytes in layout.buffers().items()
    }
    return CacheTensors(layout=layout, raw=raw)


def allocate_host_buffer(num_bytes: int) -> torch.Tensor:
    """A zeroed flat uint8 host tensor, backed by 2 MiB pages where the kernel
    allows (transparent huge pages in "madvise" or "always" mode).

    A transfer on CPU is a copy between two processes' pools (NIXL over UCX
    reads with `process_vm_readv`, which walks and pins the holder's pages), so
    page size sets its speed: a READ between two workers' pools took about a
    third of the time on huge pages (docs/performance.md). Every page is
    touched here, as `torch.zeros` would,
    so no first-touch fault lands in a step or a transfer.
    """
    if num_bytes < _HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(num_bytes, dtype=torch.uint8)
    memory = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)
    tensor = torch.frombuffer(memory, dtype=torch.uint8)  # keeps the mapping alive
    return tensor.zero_()
