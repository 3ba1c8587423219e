"""Mamba state slot bookkeeping."""

from __future__ import annotations

import pytest

from kvcache.errors import IntegrityError, RequestStateError
from kvcache.mamba_pool import MambaStatePool


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
