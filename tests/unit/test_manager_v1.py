"""Manager V1 on an 11-block pool (10 usable, 4 tokens per block): exact ids."""

from __future__ import annotations

import logging

import pytest

from kvcache import resolution
from kvcache.errors import RequestStateError
from kvcache.manager_v1 import KVCacheManagerV1
from kvcache.spec import CacheSpec

DENSE = CacheSpec(num_kv_heads=2, head_dim=4, attention_layers=(0, 1))
HYBRID = CacheSpec(
    num_kv_heads=2,
    head_dim=4,
    attention_layers=(1,),
    mamba_layers=(0, 2),
    conv_state_shape=(6, 3),
    ssm_state_shape=(2, 4, 5),
)


@pytest.fixture
def manager() -> KVCacheManagerV1:
    return KVCacheManagerV1(DENSE, num_blocks=11, block_size=4)


def test_capacity_counts(manager: KVCacheManagerV1) -> None:
    assert manager.block_size == 4
    assert manager.num_total_blocks == 11
    assert manager.num_usable_blocks == 10
    assert manager.num_free_blocks == 10


def test_allocate_grows_the_table_block_by_block(manager: KVCacheManagerV1) -> None:
    assert manager.allocate_slots("a", 5)
    assert manager.block_table("a") == [1, 2]
    assert manager.allocate_slots("b", 4)
    assert manager.block_table("b") == [3]
    assert manager.allocate_slots("a", 8)  # still two blocks
    assert manager.block_table("a") == [1, 2]
    assert manager.allocate_slots("a", 9)  # the 9th token opens block 3
    assert manager.block_table("a") == [1, 2, 4]
    assert manager.free_queue_ids() == [5, 6, 7, 8, 9, 10]
    assert manager.num_requests == 2 and manager.usage == pytest.approx(0.4)
    manager.check_integrity()


def test_shortage_returns_false_and_changes_nothing(manager: KVCacheManagerV1) -> None:
    assert manager.allocate_slots("a", 32)  # 8 blocks
    assert not manager.can_allocate("b", 12)
    assert not manager.allocate_slots("b", 12)
    assert not manager.has_request("b")
    assert manager.can_allocate("a", 40)  # a needs only 2 more
    assert not manager.allocate_slots("a", 41)
    assert manager.block_table("a") == list(range(1, 9))
    assert manager.num_free_blocks == 2
    manager.check_integrity()


def test_free_returns_blocks_tail_first_and_is_idempotent(manager: KVCacheManagerV1) -> None:
    manager.allocate_slots("a", 12)
    manager.allocate_slots("b", 4)
    manager.free("a")
    assert manager.free_queue_ids() == [5, 6, 7, 8, 9, 10, 3, 2, 1]
    manager.free("a")
    manager.free("unknown")
    assert not manager.has_request("a")
    assert manager.num_free_blocks == 9
    assert manager.allocate_slots("c", 28)
    assert manager.block_table("c") == [3, 5, 6, 7, 8, 9, 10]  # the queue's front 7, id order
    manager.check_integrity()


def test_no_prefix_reuse_even_when_asked(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resolution, "_logged", set())
    with caplog.at_level(logging.INFO, logger="kvcache.resolution"):
        manager = KVCacheManagerV1(DENSE, 11, 4, enable_block_reuse=True)
    assert not manager.enable_block_reuse
    assert "needs kv_cache.manager 'v2'" in caplog.text
    prompt = list(range(12))
    manager.allocate_slots("a", 12, prompt)
    manager.free("a")
    assert manager.match_prefix("b", prompt) == 0
    assert manager.drain_events() == []
    assert manager.prefix_queries == manager.prefix_hits == 0


def test_transfer_in_then_decode_then_abort(manager: KVCacheManagerV1) -> None:
    assert manager.allocate_for_transfer("t", 6)
    assert manager.block_table("t") == [1, 2]
    with pytest.raises(RequestStateError, match="finish_transfer"):
        manager.allocate_slots("t", 7)
    with pytest.raises(RequestStateError, match="already holds blocks"):
        manager.allocate_for_transfer("t", 6)
    manager.finish_transfer("t")
    assert manager.allocate_slots("t", 9)
    assert manager.block_table("t") == [1, 2, 3]
    assert manager.allocate_for_transfer("u", 4)
    manager.free("u")  # aborted transfer
    assert manager.free_queue_ids() == [5, 6, 7, 8, 9, 10, 4]
    with pytest.raises(RequestStateError, match="no transfer in progress"):
        manager.finish_transfer("u")
    manager.check_integrity()


def test_unknown_request_has_no_table(manager: KVCacheManagerV1) -> None:
    with pytest.raises(RequestStateError, match="unknown request 'x'"):
        manager.block_table("x")


def test_hybrid_request_gets_blocks_and_one_slot_together() -> None:
    manager = KVCacheManagerV1(HYBRID, num_blocks=11, block_size=4, num_mamba_slots=2)
    assert manager.allocate_slots("a", 4)
    assert manager.allocate_slots("a", 5)
    assert manager.mamba_slot("a") == 0
    assert manager.allocate_for_transfer("b", 4)
    assert manager.mamba_slot("b") == 1
    # Blocks are plentiful but slots are not: nothing changes.
    assert not manager.can_allocate("c", 4)
    assert not manager.allocate_slots("c", 4)
    assert not manager.has_request("c")
    assert manager.num_free_blocks == 7
    manager.free("a")
    assert manager.mamba_slot("a") is None
    assert manager.allocate_slots("c", 4)
    assert manager.mamba_slot("c") == 0
    manager.check_integrity()


def test_hybrid_manager_needs_slots() -> None:
    with pytest.raises(ValueError, match="num_mamba_slots"):
        KVCacheManagerV1(HYBRID, 11, 4)


def test_regions_keep_the_table_they_were_taken_from(manager: KVCacheManagerV1) -> None:
    # `block_table` is the manager's own list; the regions a transfer holds
    # must not follow the table as it grows.
    assert manager.allocate_slots("a", 4)
    regions = manager.regions("a")
    assert manager.allocate_slots("a", 9)
    assert manager.block_table("a") == [1, 2, 3]
    assert list(regions.block_ids) == [1]
