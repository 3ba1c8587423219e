"""Mamba state slot bookkeeping."""

from __future__ import annotations

import pytest

from kvcache.errors import IntegrityError, RequestStateError
from kvcache.layout import CONV, SSM
from kvcache.mamba_pool import MambaStatePool, mamba_state_shape
from kvcache.spec import CacheSpec


def test_one_slot_per_request_until_the_pool_is_empty() -> None:
    pool = MambaStatePool(2)
    assert pool.allocate("a") == 0
    assert pool.allocate("b") == 1
    assert pool.allocate("c") is None
    assert pool.num_free_slots == 0 and pool.num_slots == 2
    assert pool.slot_of("b") == 1 and pool.slot_of("c") is None
    pool.check_integrity()


def test_freed_slot_is_reused_and_free_is_idempotent() -> None:
    pool = MambaStatePool(2)
    pool.allocate("a")
    pool.allocate("b")
    pool.free("a")
    pool.free("a")
    pool.free("never-seen")
    assert pool.num_free_slots == 1
    assert pool.allocate("c") == 0
    pool.check_integrity()


def test_second_allocation_for_the_same_request_is_an_error() -> None:
    pool = MambaStatePool(3)
    pool.allocate("a")
    with pytest.raises(RequestStateError, match="already holds Mamba slot 0"):
        pool.allocate("a")


def test_integrity_check_catches_a_slot_both_free_and_owned() -> None:
    pool = MambaStatePool(2)
    pool.allocate("a")
    pool._free.append(0)  # corrupt on purpose: slot 0 is owned by "a"
    with pytest.raises(IntegrityError, match="both free and owned"):
        pool.check_integrity()


def test_pool_needs_a_slot() -> None:
    with pytest.raises(ValueError, match="at least one slot"):
        MambaStatePool(0)


def test_ssm_state_is_float32_even_with_a_bf16_cache() -> None:
    spec = CacheSpec(
        num_kv_heads=2,
        head_dim=4,
        attention_layers=(1,),
        dtype="bfloat16",
        mamba_layers=(0,),
        conv_state_shape=(6, 3),
        ssm_state_shape=(2, 4, 5),
    )
    conv, ssm = mamba_state_shape(spec, CONV), mamba_state_shape(spec, SSM)
    assert (conv.dtype, conv.shape, conv.num_bytes) == ("bfloat16", (6, 3), 36)
    assert (ssm.dtype, ssm.shape, ssm.num_bytes) == ("float32", (2, 4, 5), 160)
    with pytest.raises(ValueError, match="kind must be one of"):
        mamba_state_shape(spec, "attention")
