"""Size a worker's cache pools, build its manager and allocate its tensors."""

from __future__ import annotations

from engine.worker_config import WorkerConfig
from kvcache.factory import create_manager
from kvcache.hashing import cache_namespace
from kvcache.manager import KVCacheManager
from kvcache.sizing import CacheSizing, size_cache
from kvcache.tensors import CacheTensors, allocate_cache_tensors
from models.config import ModelConfig


def build_cache(
    config: WorkerConfig, model_config: ModelConfig, sizing: CacheSizing | None = None
) -> tuple[KVCacheManager, CacheTensors, CacheSizing]:
    """The manager, its pool tensors and the sizing they were built with.

    `model_config` is the rank's (its KV heads only, with tensor parallelism).
    `sizing` None sizes the pools here; ranks 1.. of a tensor-parallel
    instance pass rank 0's, so block ids and slots mean the same on every rank.
    """
    spec = model_config.cache_spec(config.dtype)
    if sizing is None:
        max_len = model_config.max_position_embeddings
        if config.max_tokens is not None:
            max_len = min(max_len, config.max_tokens)
        sizing = size_cache(
            spec,
            block_size=config.block_size,
            max_model_len=max_len,
            max_batch_size=config.max_batch_size,
            max_tokens=config.max_tokens,
            memory_bytes=config.kv_cache_memory_bytes,
            device=config.device,
            # Pinned handoffs (context) and pulls in flight (generation) hold a
            # slot outside the running batch: leave as many again for them.
            num_mamba_slots=2 * config.max_batch_size,
        )
    manager = create_manager(
        config.manager,
        spec,
        sizing.num_blocks,
        config.block_size,
        sizing.num_mamba_slots,
        enable_block_reuse=config.enable_block_reuse,
        hash_namespace=cache_namespace(model_config.architecture, spec.dtype),
    )
    return manager, allocate_cache_tensors(manager, config.device), sizing
