"""What an instance on a GPU holds beside its weights and its KV cache, and
so the cache budget its share of the GPU leaves (`GpuShare`); pure Python.

The cache gets what the instance's share leaves once everything else it
will hold is counted (`InstanceOverheads`):

    share x fraction of the GPU
      - weights                   measured after loading (`kvcache.device_memory`)
      - CUDA context              | RuntimeReserve: allowances, and the pool
      - cuBLAS / Triton workspace | the decode graphs capture into after the
      - NCCL buffers (TP > 1)     | cache is allocated
      - CUDA-graph pool           |
      - one step's activations
      - the largest transient peak of a step (TransientPeaks)
      = KV blocks + Mamba slots

`engine.cache_build.instance_overheads` fills these in from a worker's
config and model; `kvcache.sizing` turns the budget into blocks and slots.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvcache.device_memory import DeviceMemory

_MIB = 1 << 20


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
