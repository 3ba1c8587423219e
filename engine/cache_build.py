"""Size a worker's cache pools, build its manager and allocate its tensors."""

from __future__ import annotations

from engine.worker_config import WorkerConfig
from kvcache.dtypes import DTYPE_BYTES
from kvcache.factory import create_manager
from kvcache.hashing import cache_namespace
from kvcache.manager import KVCacheManager
from kvcache.sizing import CacheSizing, GpuShare, size_instance_cache, step_activation_bytes
from kvcache.tensors import CacheTensors, allocate_cache_tensors
from models.base import CausalLM
from models.config import ModelConfig


def gpu_share(config: WorkerConfig, model_config: ModelConfig, model: CausalLM) -> GpuShare | None:
    """This instance's part of its GPU, measured now that its weights are in;
    None unless its cache is sized by `memory_fraction` on CUDA."""
    if config.memory_fraction is None or not config.device.startswith("cuda"):
        return None
    from kvcache.tensors import device_memory

    dtype = config.dtype or model_config.dtype
    activations = step_activation_bytes(
        num_tokens=config.max_num_tokens,
        num_sequences=config.max_batch_size,
        hidden_size=model_config.hidden_size,
        intermediate_size=model_config.intermediate_size,
        vocab_size=model_config.vocab_size,
        dtype_bytes=DTYPE_BYTES[dtype],
    )
    tensors = [*model.parameters(), *model.buffers()]
    weights = sum(t.numel() * t.element_size() for t in tensors)
    memory = device_memory(config.device, weights)
    return GpuShare(memory, config.gpu_share, config.memory_fraction, activations)


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
