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

On a GPU the cache gets what the instance's share leaves once everything
else it will hold is counted (`InstanceOverheads`):

    share x fraction of the GPU
      - weights            measured after loading (`kvcache.device_memory`)
      - CUDA context       \
      - cuBLAS / Triton     |  RuntimeReserve: allowances, and the pool the
      - NCCL (TP > 1)       |  decode graphs capture into after the cache
      - CUDA-graph pool    /   is allocated
      - one step's activations
      - the largest transient peak of a step (TransientPeaks)
      = KV blocks + Mamba slots
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

from kvcache.device_memory import DeviceMemory, free_device_memory
from kvcache.errors import CacheSizingError
from kvcache.pool_layout import block_major_slot_layout
from kvcache.spec import CacheSpec

DEFAULT_GPU_MEMORY_FRACTION = 0.9
_MIB = 1 << 20
# A worker keeps as many Mamba slots again as batch slots: pinned handoffs
# (context) and pulls in flight (generation) hold one outside the running batch.
MAMBA_SLOTS_PER_BATCH_SLOT = 2


# Allowances for what a CUDA process holds beside its tensors. They are not
# measured here: `python -m benchmarks.gpu_check` measures an instance's
# whole footprint against its budget (part "sizing") on the GPU it runs on.
CUDA_CONTEXT_BYTES = 512 * _MIB  # the context and the loaded kernel images
WORKSPACE_BYTES = 128 * _MIB  # cuBLAS workspaces (per stream), Triton's launch state
NCCL_BYTES = 512 * _MIB  # one communicator's buffers, tensor-parallel instances only


@dataclass(frozen=True)
class RuntimeReserve:
    """Bytes a CUDA instance holds beside its weights, activations and cache.

    cuda_context is held before the weights are measured, so it counts
    against the share but is already gone from the free memory; the rest is
    allocated after the cache: the workspaces on the first products, the
    NCCL buffers on the first collective, the graph pool when the decode
    graphs are captured (`engine.decode_graphs`)."""

    cuda_context: int = CUDA_CONTEXT_BYTES
    workspaces: int = WORKSPACE_BYTES
    nccl: int = 0
    graph_pool: int = 0

    @property
    def after_cache(self) -> int:
        return self.workspaces + self.nccl + self.graph_pool


@dataclass(frozen=True)
class TransientPeaks:
    """Temporaries one step allocates and frees inside one layer or phase,
    in bytes, on top of its activations. They run one after another (Mamba
    layers, attention layers, MoE layers, then sampling), so the largest is
    what the cache must leave room for."""

    ssd_scan: int = 0  # a prompt chunk's chunked scan (`models.layers.ssd`)
    attention_gather: int = 0  # a continued chunk's keys and values (`gather_kv`)
    moe_gather: int = 0  # expert weights gathered per pair (`routed_gathered`)
    sampling: int = 0  # sort, filters and the float64 CDF over the vocabulary

    @property
    def largest(self) -> int:
        return max(getattr(self, f.name) for f in fields(self))

    def largest_name(self) -> str:
        return max(fields(self), key=lambda f: getattr(self, f.name)).name


@dataclass(frozen=True)
class InstanceOverheads:
    """Everything an instance holds on its GPU but its weights and cache."""

    activations: int  # one step's live activations (`step_activation_bytes`)
    peaks: TransientPeaks
    reserve: RuntimeReserve

    @property
    def after_cache(self) -> int:
        """What is allocated after the cache (so the free memory still has it)."""
        return self.activations + self.peaks.largest + self.reserve.after_cache

    @property
    def total(self) -> int:
        return self.reserve.cuda_context + self.after_cache

    def describe(self) -> str:
        reserve, peaks = self.reserve, self.peaks
        return (
            f"{self.activations / _MIB:.1f} MiB of activations, "
            f"{peaks.largest / _MIB:.1f} MiB of {peaks.largest_name()} peak, "
            f"{reserve.cuda_context / _MIB:.1f} MiB CUDA context, "
            f"{reserve.workspaces / _MIB:.1f} MiB workspaces, {reserve.nccl / _MIB:.1f} MiB NCCL, "
            f"{reserve.graph_pool / _MIB:.1f} MiB CUDA-graph pool"
        )


@dataclass(frozen=True)
class GpuShare:
    """An instance's part of a GPU it may share with others.

    share: its `num_gpus` (0.5 when two instances share one GPU).
    fraction: `kv_cache.memory_fraction`, a fraction of the share.
    overheads: what it holds beside weights and cache (`InstanceOverheads`).
    """

    memory: DeviceMemory
    share: float
    fraction: float
    overheads: InstanceOverheads

    def budget(self) -> tuple[int, str]:
        """(bytes for the KV cache, how they were reckoned).

        `fraction` of the share is all this instance may hold: weights,
        runtime reserve, activations, peaks and cache together. So instances
        whose shares add up to one GPU never ask for more than it has,
        whichever starts first; and none takes more than is free when it
        starts, less what it will allocate after its cache.
        """
        memory, overheads = self.memory, self.overheads
        share_bytes = int(memory.total * self.share * self.fraction)
        by_share = share_bytes - memory.weights - overheads.total
        by_free = memory.free - overheads.after_cache
        source = (
            f"{self.fraction:g} x {self.share:g} of {memory.total / _MIB:.1f} MiB, less "
            f"{memory.weights / _MIB:.1f} MiB of weights, {overheads.describe()}; "
            f"{memory.free / _MIB:.1f} MiB free"
        )
        return min(by_share, by_free), source


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


def step_activation_bytes(
    *,
    num_tokens: int,
    num_sequences: int,
    hidden_size: int,
    intermediate_size: int,
    vocab_size: int,
    dtype_bytes: int,
) -> int:
    """A bound on one step's live activations at `num_tokens` tokens: a few
    hidden-sized tensors and the MLP's gate and up projections per token, and
    float32 logits for every sequence sampled."""
    per_token = 4 * hidden_size + 2 * intermediate_size
    return num_tokens * per_token * dtype_bytes + num_sequences * vocab_size * 4


# fp32 temporaries of a chunked SSD scan, per element of its [blocks, H, Q, Q]
# decay / score tensors (`_segment_sums`' expansion and cumsum, the decay,
# the scores) and of its [L, H, P] ones (x * dt, intra-block and carried
# outputs, their sum, the D skip).
_SSD_SQUARE_TENSORS = 4
_SSD_TOKEN_TENSORS = 5


def ssd_scan_bytes(
    *, num_tokens: int, num_heads: int, head_dim: int, state_size: int, chunk_size: int
) -> int:
    """A bound on the temporaries of one prompt chunk's SSD scan of
    `num_tokens` tokens (the step's budget bounds a chunk), all float32: the
    squares of its blocks, its per-token inputs and outputs, B and C
    expanded to the heads, and the per-block states."""
    blocks = -(-num_tokens // chunk_size)
    squares = _SSD_SQUARE_TENSORS * blocks * num_heads * chunk_size * chunk_size
    tokens = num_tokens * num_heads * (_SSD_TOKEN_TENSORS * head_dim + 2 * state_size)
    states = 3 * blocks * num_heads * head_dim * state_size
    return 4 * (squares + tokens + states)


def attention_gather_bytes(
    *, max_model_len: int, num_kv_heads: int, head_dim: int, dtype_bytes: int
) -> int:
    """A prompt chunk that continues a cached prefix reads its sequence's keys
    and values back from the cache in one gather (`gather_kv`), up to the
    whole context, and casts them for SDPA: two copies of K and V."""
    return 2 * 2 * max_model_len * num_kv_heads * head_dim * dtype_bytes


def sampling_bytes(*, num_rows: int, vocab_size: int) -> int:
    """Temporaries of sampling `num_rows` rows over the vocabulary, per
    element: the sort's int64 order, the float64 CDF, and four float32
    copies (scaled, filtered, finite, probabilities). The float32 logits
    themselves are in `step_activation_bytes`."""
    return num_rows * vocab_size * (8 + 8 + 4 * 4)


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
