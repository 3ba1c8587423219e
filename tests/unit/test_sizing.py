"""Cache sizing from a token capacity or a memory budget, and its errors."""

from __future__ import annotations

import pytest
import torch

from kvcache.errors import CacheSizingError
from kvcache.factory import create_manager
from kvcache.sizing import bytes_per_block, bytes_per_mamba_slot, size_cache, size_instance_cache
from kvcache.spec import CacheSpec
from kvcache.tensors import allocate_cache_tensors

DENSE = CacheSpec(num_kv_heads=2, head_dim=8, attention_layers=(0, 1, 2, 3))  # float32
HYBRID = CacheSpec(
    num_kv_heads=2,
    head_dim=8,
    attention_layers=(1,),
    mamba_layers=(0, 2),
    conv_state_shape=(10, 3),
    ssm_state_shape=(2, 4, 5),
)


def test_bytes_per_block_and_slot() -> None:
    assert bytes_per_block(DENSE, 16) == 4 * 2 * 16 * 2 * 8 * 4
    # Per Mamba layer: SSM 160 bytes, conv 120 bytes padded to 128.
    assert bytes_per_mamba_slot(HYBRID) == 2 * (160 + 128)
    assert bytes_per_mamba_slot(DENSE) == 0


def test_max_tokens_rounds_down_to_whole_blocks_plus_the_null_block() -> None:
    sizing = size_cache(DENSE, block_size=16, max_model_len=64, max_batch_size=4, max_tokens=100)
    assert sizing.num_blocks == 6 + 1
    assert sizing.num_tokens == 96
    assert sizing.num_mamba_slots == 0


def test_hybrid_slots_default_to_max_batch_size() -> None:
    sizing = size_cache(HYBRID, block_size=16, max_model_len=64, max_batch_size=5, max_tokens=64)
    assert sizing.num_mamba_slots == 5
    overridden = size_cache(
        HYBRID, block_size=16, max_model_len=64, max_batch_size=5, max_tokens=64, num_mamba_slots=2
    )
    assert overridden.num_mamba_slots == 2


def test_memory_budget_pays_mamba_slots_first_then_blocks() -> None:
    block, slot = bytes_per_block(HYBRID, 16), bytes_per_mamba_slot(HYBRID)
    budget = 4 * slot + 21 * block + block // 2
    sizing = size_cache(
        HYBRID, block_size=16, max_model_len=64, max_batch_size=4, memory_bytes=budget
    )
    assert (sizing.num_blocks, sizing.num_mamba_slots) == (21, 4)
    assert sizing.total_bytes <= budget
    half = size_cache(
        DENSE,
        block_size=16,
        max_model_len=16,
        max_batch_size=4,
        memory_bytes=10 * bytes_per_block(DENSE, 16),
        memory_fraction=0.5,
    )
    assert half.num_blocks == 5


def test_sized_cache_allocates_within_budget() -> None:
    budget = 1 << 20
    sizing = size_cache(
        HYBRID, block_size=16, max_model_len=64, max_batch_size=4, memory_bytes=budget
    )
    manager = create_manager("v2", HYBRID, sizing.num_blocks, 16, sizing.num_mamba_slots)
    allocated = sum(b.numel() for b in allocate_cache_tensors(manager).buffers().values())
    assert allocated == sizing.total_bytes <= budget


def test_budget_too_small_for_one_sequence_names_numbers_and_settings() -> None:
    with pytest.raises(CacheSizingError) as info:
        size_cache(
            HYBRID,
            block_size=16,
            max_model_len=4096,
            max_batch_size=64,
            memory_bytes=64 * bytes_per_mamba_slot(HYBRID) + 10 * bytes_per_block(HYBRID, 16),
        )
    message = str(info.value)
    assert "(max_model_len=4096) needs 256 blocks" in message
    assert "64 Mamba slots" in message and "holds 9 blocks" in message
    assert "kv_cache.memory_fraction" in message and "max_batch_size" in message


def test_max_tokens_below_one_sequence_is_an_error() -> None:
    with pytest.raises(CacheSizingError, match="raise max_tokens to at least 128"):
        size_cache(DENSE, block_size=16, max_model_len=128, max_batch_size=4, max_tokens=100)


def test_max_tokens_off_the_block_grid_caps_sequences_at_its_whole_blocks() -> None:
    sizing = size_instance_cache(
        DENSE, block_size=16, model_len=8192, max_batch_size=4, max_tokens=2900
    )
    assert sizing.num_tokens == 2896  # 181 whole blocks
    with pytest.raises(CacheSizingError, match="raise max_tokens to at least 16"):
        size_instance_cache(DENSE, block_size=16, model_len=8192, max_batch_size=4, max_tokens=10)


def test_no_sizing_source_is_an_error() -> None:
    with pytest.raises(CacheSizingError, match="set max_tokens, or kv_cache_memory_bytes"):
        size_cache(DENSE, block_size=16, max_model_len=128, max_batch_size=4, device="cpu")
    with pytest.raises(CacheSizingError, match=r"memory_fraction must be in \(0, 1\]"):
        size_cache(
            DENSE,
            block_size=16,
            max_model_len=16,
            max_batch_size=4,
            memory_bytes=1,
            memory_fraction=2,
        )


@pytest.mark.gpu(1)
def test_gpu_fraction_of_free_memory() -> None:
    free, _ = torch.cuda.mem_get_info(0)
    sizing = size_cache(
        DENSE,
        block_size=16,
        max_model_len=1024,
        max_batch_size=8,
        memory_fraction=0.01,
        device="cuda:0",
    )
    assert sizing.total_bytes <= 0.01 * free
    assert sizing.num_blocks - 1 >= 1024 // 16
