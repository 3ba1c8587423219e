"""Size a worker's cache pools, build its manager and allocate its tensors."""

from __future__ import annotations

from engine.decode_graphs import graph_batch_sizes
from engine.worker_config import WorkerConfig
from kvcache.device_memory import device_memory
from kvcache.dtypes import DTYPE_BYTES
from kvcache.factory import create_manager
from kvcache.gpu_share import (
    NCCL_BYTES,
    GpuShare,
    InstanceOverheads,
    RuntimeReserve,
    TransientPeaks,
    attention_gather_bytes,
    sampling_bytes,
    ssd_scan_bytes,
    step_activation_bytes,
)
from kvcache.hashing import cache_namespace
from kvcache.manager import KVCacheManager
from kvcache.sizing import CacheSizing, size_instance_cache
from kvcache.tensors import CacheTensors, allocate_cache_tensors
from models.config import ModelConfig
from models.layers.moe_experts import GATHER_BYTES


def gpu_share(
    config: WorkerConfig, model_config: ModelConfig, weights_bytes: int | None
) -> GpuShare | None:
    """This instance's part of its GPU, measured now that its weights are in
    (`weights_bytes`: what loading them left on the device,
    `kvcache.device_memory.DeviceBytesMeter`); None unless its cache is sized
    by `memory_fraction` on CUDA."""
    if config.memory_fraction is None or not config.device.startswith("cuda"):
        return None
    if weights_bytes is None:
        raise ValueError("a cache sized by memory_fraction on CUDA needs the measured weights")
    memory = device_memory(config.device, weights_bytes)
    overheads = instance_overheads(config, model_config)
    return GpuShare(memory, config.gpu_share, config.memory_fraction, overheads)


def instance_overheads(config: WorkerConfig, model_config: ModelConfig) -> InstanceOverheads:
    """What the instance holds on its GPU beside weights and cache: the one
    reckoning the worker sizes by and `benchmarks.gpu_check` checks.
    `model_config` is the rank's (its heads only, with tensor parallelism)."""
    dtype_bytes = DTYPE_BYTES[config.dtype or model_config.dtype]

    def activations(num_tokens: int, num_sequences: int) -> int:
        return step_activation_bytes(
            num_tokens=num_tokens,
            num_sequences=num_sequences,
            hidden_size=model_config.hidden_size,
            intermediate_size=model_config.intermediate_size,
            vocab_size=model_config.vocab_size,
            dtype_bytes=dtype_bytes,
        )

    # Verify steps sample every draft position too.
    sampled_rows = config.max_batch_size * (1 + verify_depth(config))
    graph_sizes = graph_batch_sizes(config.max_batch_size)
    reserve = RuntimeReserve(
        nccl=NCCL_BYTES if config.tensor_parallel_size > 1 else 0,
        # The graphs replay the forward only; logits are computed after it.
        graph_pool=activations(max(graph_sizes), 0) if graph_sizes else 0,
    )
    return InstanceOverheads(
        activations=activations(config.max_num_tokens, sampled_rows),
        peaks=_transient_peaks(config, model_config, dtype_bytes, sampled_rows),
        reserve=reserve,
    )


def _transient_peaks(
    config: WorkerConfig, model_config: ModelConfig, dtype_bytes: int, sampled_rows: int
) -> TransientPeaks:
    mamba, moe = model_config.mamba, model_config.moe
    spec = model_config.cache_spec(config.dtype)
    return TransientPeaks(
        ssd_scan=0
        if mamba is None
        else ssd_scan_bytes(
            num_tokens=config.max_num_tokens,
            num_heads=mamba.num_heads,
            head_dim=mamba.head_dim,
            state_size=mamba.state_size,
            chunk_size=mamba.chunk_size,
        ),
        attention_gather=0
        if not spec.num_attention_layers
        else attention_gather_bytes(
            max_model_len=model_config.max_position_embeddings,
            num_kv_heads=model_config.num_key_value_heads,
            head_dim=model_config.head_dim,
            dtype_bytes=DTYPE_BYTES[spec.dtype],
        ),
        moe_gather=0 if moe is None else GATHER_BYTES,
        sampling=sampling_bytes(num_rows=sampled_rows, vocab_size=model_config.vocab_size),
    )


def build_cache(
    config: WorkerConfig,
    model_config: ModelConfig,
    sizing: CacheSizing | None = None,
    gpu_share: GpuShare | None = None,
) -> tuple[KVCacheManager, CacheTensors, CacheSizing]:
    """The manager, its pool tensors and the sizing they were built with.

    `model_config` is the rank's (its KV heads only, with tensor parallelism).
    `sizing` None sizes the pools here (by `gpu_share` when the cache is sized
    from the GPU); ranks 1.. of a tensor-parallel instance pass rank 0's, so
    block ids and slots mean the same on every rank.
    """
    spec = model_config.cache_spec(config.dtype)
    if sizing is None:
        sizing = size_instance_cache(
            spec,
            block_size=config.block_size,
            model_len=model_config.max_position_embeddings,
            max_batch_size=config.max_batch_size,
            max_tokens=config.max_tokens,
            memory_bytes=config.kv_cache_memory_bytes,
            device=config.device,
            gpu_share=gpu_share,
            num_snapshot_slots=0 if config.snapshots is None else config.snapshots.num_slots,
            verify_depth=verify_depth(config),
        )
    manager = create_manager(
        config.manager,
        spec,
        sizing.num_blocks,
        config.block_size,
        sizing.num_mamba_slots,
        enable_block_reuse=config.enable_block_reuse,
        hash_namespace=cache_namespace(model_config.architecture, spec.dtype),
        snapshots=config.snapshots,
        num_verify_slots=sizing.num_verify_slots,
        verify_depth=verify_depth(config),
    )
    return manager, allocate_cache_tensors(manager, config.device), sizing


def verify_depth(config: WorkerConfig) -> int:
    """Drafts a step verifies per sequence (0 without speculative decoding)."""
    return 0 if config.speculative is None else config.speculative.num_speculative_tokens
