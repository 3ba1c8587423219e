"""How many KV blocks and Mamba slots a worker's cache gets.

Either from a token capacity (`max_tokens`, rounded down to whole blocks) or
from memory: a fraction of a stated byte budget (any device), a fraction of
the instance's share of its GPU (`GpuShare`, measured by the worker after its
weights are loaded), or, when a CUDA device is given and nothing else, a
fraction of the device's free memory. Mamba slots (one per running request, default
`max_batch_size`, plus the snapshot slots of hybrid prefix reuse) come out of
the budget first; the rest becomes KV blocks.
Sizing fails early, naming the numbers and the setting to change, when one
max-length sequence would not fit.
On a GPU, the budget a `GpuShare` leaves is reckoned in `kvcache.gpu_share`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from kvcache.device_memory import free_device_memory
from kvcache.errors import CacheSizingError
from kvcache.gpu_share import GpuShare
from kvcache.pool_layout import block_major_slot_layout
from kvcache.spec import CacheSpec

DEFAULT_GPU_MEMORY_FRACTION = 0.9
_MIB = 1 << 20
# A worker keeps as many Mamba slots again as batch slots: pinned handoffs
# (context) and pulls in flight (generation) hold one outside the running batch.
MAMBA_SLOTS_PER_BATCH_SLOT = 2


def host_available_bytes() -> int:
    """Memory new allocations on this host can take now, in bytes: the kernel's
    MemAvailable (free memory plus the page cache it can drop), or, where
    /proc/meminfo does not say, the free physical pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class CacheSizing:
    """num_blocks includes the null block; `num_tokens` counts usable capacity."""

    num_blocks: int
    num_mamba_slots: int
    block_size: int
    bytes_per_block: int
    bytes_per_slot: int
    # Mamba state snapshots (hybrid prefix reuse), slots of the same size.
    num_snapshot_slots: int = 0
    # Scratch slots of speculative verify steps (`kvcache.verify_slots`).
    num_verify_slots: int = 0

    @property
    def num_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def mamba_bytes(self) -> int:
        """Running, snapshot and verify Mamba slots together."""
        slots = self.num_mamba_slots + self.num_snapshot_slots + self.num_verify_slots
        return slots * self.bytes_per_slot

    @property
    def snapshot_bytes(self) -> int:
        return self.num_snapshot_slots * self.bytes_per_slot

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block + self.mamba_bytes


def bytes_per_block(spec: CacheSpec, block_size: int) -> int:
    """Bytes of one block across all attention layers (same in V1 and V2)."""
    return spec.num_attention_layers * spec.kv_bytes_per_block_per_layer(block_size)


def bytes_per_mamba_slot(spec: CacheSpec) -> int:
    """Bytes of one Mamba slot across all Mamba layers; the V2 figure, which
    includes alignment padding and so bounds V1's from above."""
    return block_major_slot_layout(spec)[0] if spec.is_hybrid else 0


def size_instance_cache(
    spec: CacheSpec,
    *,
    block_size: int,
    model_len: int,
    max_batch_size: int,
    max_tokens: int | None = None,
    memory_bytes: int | None = None,
    device: object | None = None,
    gpu_share: GpuShare | None = None,
    num_snapshot_slots: int = 0,
    verify_depth: int = 0,
) -> CacheSizing:
    """The cache of one serving instance: the plan sizes it with this before any
    worker starts (to print and check it), the worker again to build it.

    No sequence is longer than the model allows or than the whole blocks
    `max_tokens` holds (2,900 tokens in blocks of 16: 181 blocks, 2,896
    tokens). A `gpu_share` (known only inside the worker) sizes it when
    neither `max_tokens` nor `memory_bytes` is given.
    """
    cache_len = max(max_tokens // block_size, 1) * block_size if max_tokens else model_len
    return size_cache(
        spec,
        block_size=block_size,
        max_model_len=min(model_len, cache_len),
        max_batch_size=max_batch_size,
        max_tokens=max_tokens,
        memory_bytes=memory_bytes,
        device=device,
        num_mamba_slots=MAMBA_SLOTS_PER_BATCH_SLOT * max_batch_size,
        gpu_share=gpu_share,
        num_snapshot_slots=num_snapshot_slots,
        num_verify_slots=num_verify_slots(max_batch_size, verify_depth),
    )


def num_verify_slots(max_batch_size: int, verify_depth: int) -> int:
    """Scratch slots of a hybrid cache whose steps verify `verify_depth`
    drafts per sequence: one lane of that depth per sequence of a step."""
    return max_batch_size * verify_depth


def size_cache(
    spec: CacheSpec,
    *,
    block_size: int,
    max_model_len: int,
    max_batch_size: int,
    max_tokens: int | None = None,
    memory_bytes: int | None = None,
    memory_fraction: float | None = None,
    device: object | None = None,
    num_mamba_slots: int | None = None,
    gpu_share: GpuShare | None = None,
    num_snapshot_slots: int = 0,
    num_verify_slots: int = 0,
) -> CacheSizing:
    """Blocks and slots for the cache; see the module docstring for the modes.

    `max_tokens` wins when set. Otherwise `memory_bytes` (times
    `memory_fraction`, default 1.0), or `gpu_share`'s budget, or, with a CUDA
    `device`, its free memory times `memory_fraction` (default 0.9). Raises CacheSizingError when one
    sequence of `max_model_len` tokens plus the Mamba slots does not fit.
    """
    if memory_fraction is not None and not 0.0 < memory_fraction <= 1.0:
        raise CacheSizingError(f"kv_cache.memory_fraction must be in (0, 1], got {memory_fraction}")
    slots = (
        (num_mamba_slots if num_mamba_slots is not None else max_batch_size)
        if spec.is_hybrid
        else 0
    )
    sizing = CacheSizing(
        0,
        slots,
        block_size,
        bytes_per_block(spec, block_size),
        bytes_per_mamba_slot(spec),
        num_snapshot_slots if spec.is_hybrid else 0,
        num_verify_slots if spec.is_hybrid else 0,
    )
    needed = -(-max_model_len // block_size)
    is_cuda = device is not None and str(device).startswith("cuda")
    if max_tokens is not None:
        return _from_tokens(sizing, max_tokens, max_model_len, needed, device if is_cuda else None)
    if memory_bytes is not None:
        fraction = 1.0 if memory_fraction is None else memory_fraction
        source = f"{fraction:g} x kv_cache_memory_bytes ({memory_bytes / _MIB:.1f} MiB)"
        return _from_budget(sizing, int(memory_bytes * fraction), source, max_model_len, needed)
    if gpu_share is not None:
        budget, source = gpu_share.budget()
        return _from_budget(sizing, budget, source, max_model_len, needed)
    if is_cuda:
        fraction = DEFAULT_GPU_MEMORY_FRACTION if memory_fraction is None else memory_fraction
        free = free_device_memory(str(device))
        source = f"{fraction:g} x {free / _MIB:.1f} MiB free on {device} after weights"
        return _from_budget(sizing, int(free * fraction), source, max_model_len, needed)
    raise CacheSizingError(
        "cannot size the KV cache: set max_tokens, or kv_cache_memory_bytes, "
        "or run on a CUDA device to size from free device memory"
    )


def _from_tokens(
    sizing: CacheSizing, max_tokens: int, max_model_len: int, needed: int, device: object | None
) -> CacheSizing:
    usable = max_tokens // sizing.block_size
    if usable < needed:
        raise CacheSizingError(
            f"max_tokens={max_tokens} holds {usable} blocks of {sizing.block_size} tokens, but one "
            f"max-length sequence (max_model_len={max_model_len}) needs {needed} blocks; raise "
            f"max_tokens to at least {needed * sizing.block_size} or lower max_model_len"
        )
    result = _with_blocks(sizing, usable + 1)
    if device is not None:
        free = free_device_memory(str(device))
        if result.total_bytes > free:
            raise CacheSizingError(
                f"the KV cache for max_tokens={max_tokens} ({result.total_bytes / _MIB:.1f} MiB, "
                f"incl. {_slots(sizing)}) exceeds the {free / _MIB:.1f} MiB free "
                f"on {device} after weights; lower max_tokens or max_batch_size"
            )
    return result


def _from_budget(
    sizing: CacheSizing, budget: int, source: str, max_model_len: int, needed: int
) -> CacheSizing:
    mamba_bytes = sizing.mamba_bytes
    kv_bytes = budget - mamba_bytes
    # One extra block for the null block, which the budget must also hold.
    usable = max(kv_bytes // sizing.bytes_per_block - 1, 0) if sizing.bytes_per_block else 0
    if usable < needed:
        raise CacheSizingError(
            f"KV cache budget {budget / _MIB:.1f} MiB ({source}) minus {mamba_bytes / _MIB:.1f} MiB "
            f"for {_slots(sizing)} holds {usable} blocks of "
            f"{sizing.block_size} tokens ({sizing.bytes_per_block} bytes each), but one max-length "
            f"sequence (max_model_len={max_model_len}) needs {needed} blocks "
            f"({(needed + 1) * sizing.bytes_per_block / _MIB:.1f} MiB with the null block); raise the "
            "memory budget (kv_cache.memory_fraction or kv_cache_memory_bytes), or lower "
            "max_model_len, max_batch_size or kv_cache.snapshots.num_slots"
        )
    return _with_blocks(sizing, usable + 1)


def _slots(sizing: CacheSizing) -> str:
    text = f"{sizing.num_mamba_slots} Mamba slots"
    if sizing.num_snapshot_slots:
        text += f" and {sizing.num_snapshot_slots} snapshot slots"
    if sizing.num_verify_slots:
        text += f" and {sizing.num_verify_slots} verify slots"
    return text


def _with_blocks(sizing: CacheSizing, num_blocks: int) -> CacheSizing:
    return replace(sizing, num_blocks=num_blocks)
