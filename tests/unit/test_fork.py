"""Forking a request's cache (`KVCacheManager.fork`, `kvcache.fork`) on an
11-block pool (10 usable, 4 tokens per block), managers V1 and V2."""

from __future__ import annotations

import pytest

from kvcache.errors import RequestStateError
from kvcache.manager import KVCacheManager
from kvcache.manager_v1 import KVCacheManagerV1
from kvcache.manager_v2 import KVCacheManagerV2
from kvcache.spec import CacheSpec

DENSE = CacheSpec(num_kv_heads=2, head_dim=4, attention_layers=(0, 1))
HYBRID = CacheSpec(
    num_kv_heads=2,
    head_dim=4,
    attention_layers=(1,),
    mamba_layers=(0,),
    conv_state_shape=(6, 3),
    ssm_state_shape=(2, 4, 5),
)
PROMPT = list(range(100, 110))  # 10 tokens: two full blocks and a partial one

MANAGERS = {
    "v1": lambda spec, slots: KVCacheManagerV1(spec, 11, 4, slots),
    "v2": lambda spec, slots: KVCacheManagerV2(spec, 11, 4, slots),
    "v2-reuse": lambda spec, slots: KVCacheManagerV2(
        spec, 11, 4, slots, enable_block_reuse=True, hash_namespace="m"
    ),
}


@pytest.fixture(params=sorted(MANAGERS))
def manager(request: pytest.FixtureRequest) -> KVCacheManager:
    return MANAGERS[request.param](DENSE, 0)


def prefilled(manager: KVCacheManager, request_id: str = "p") -> None:
    tokens = PROMPT if manager.enable_block_reuse else None
    assert manager.allocate_slots(request_id, len(PROMPT), tokens)


def test_children_share_the_full_blocks_and_copy_the_partial_one(manager: KVCacheManager) -> None:
    prefilled(manager)
    assert manager.block_table("p") == [1, 2, 3]
    assert manager.fork("p", "p#1", 10) and manager.fork("p", "p#2", 10)
    assert manager.block_table("p#1") == [1, 2, 4]
    assert manager.block_table("p#2") == [1, 2, 5]
    # Three samples of a 10-token prompt hold the two full blocks once.
    assert manager.num_free_blocks == 10 - 5
    manager.check_integrity()
    copies = manager.take_copies()
    assert copies.block_loads == [(3, 4), (3, 5)] and copies.slot_loads == []
    manager.step_done()
    assert not manager.take_copies()
    manager.check_integrity()


def test_every_sample_frees_its_share(manager: KVCacheManager) -> None:
    prefilled(manager)
    manager.fork("p", "p#1", 10)
    manager.take_copies()
    manager.step_done()
    manager.free("p")
    manager.check_integrity()
    assert manager.num_free_blocks == 10 - 3
    manager.free("p#1")
    manager.check_integrity()
    assert manager.num_free_blocks == 10


def test_a_parent_freed_before_the_copy_ran_keeps_its_block_until_then(
    manager: KVCacheManager,
) -> None:
    prefilled(manager)
    manager.fork("p", "p#1", 10)
    manager.free("p")
    # Block 3 is the copy's source: no allocation may take it yet.
    assert 3 not in manager.free_queue_ids()
    manager.check_integrity()
    assert manager.take_copies().block_loads == [(3, 4)]
    manager.step_done()
    assert 3 in manager.free_queue_ids()
    manager.free("p#1")
    manager.check_integrity()
    assert manager.num_free_blocks == 10


def test_a_child_freed_before_its_copy_drops_it(manager: KVCacheManager) -> None:
    prefilled(manager)
    manager.fork("p", "p#1", 10)
    manager.free("p#1")
    assert not manager.take_copies()
    manager.check_integrity()
    manager.free("p")
    assert manager.num_free_blocks == 10


def test_a_prompt_of_whole_blocks_copies_nothing(manager: KVCacheManager) -> None:
    tokens = PROMPT[:8] if manager.enable_block_reuse else None
    assert manager.allocate_slots("p", 8, tokens)
    assert manager.fork("p", "p#1", 8)
    assert manager.block_table("p#1") == [1, 2]
    assert not manager.take_copies()
    manager.check_integrity()


def test_fork_without_a_free_block_changes_nothing(manager: KVCacheManager) -> None:
    prefilled(manager)
    assert manager.allocate_slots("other", 28)  # the 7 blocks left
    assert not manager.can_fork("p", 10)
    assert not manager.fork("p", "p#1", 10)
    assert not manager.has_request("p#1")
    manager.check_integrity()


def test_fork_past_the_parents_cache_is_refused(manager: KVCacheManager) -> None:
    prefilled(manager)
    with pytest.raises(RequestStateError, match="does not hold 13 tokens"):
        manager.fork("p", "p#1", 13)


def test_hybrid_fork_copies_the_mamba_slot_and_parks_a_freed_source() -> None:
    manager = KVCacheManagerV1(HYBRID, 11, 4, 3)
    prefilled(manager)
    assert manager.mamba_slot("p") == 0
    assert manager.fork("p", "p#1", 10)
    assert manager.mamba_slot("p#1") == 1
    manager.free("p")
    pool = manager.mamba_pool
    assert pool is not None and pool.num_free_slots == 1  # slot 0 parked for the copy
    manager.check_integrity()
    copies = manager.take_copies()
    assert copies.slot_loads == [(0, 1)] and copies.block_loads == [(3, 4)]
    manager.step_done()
    assert pool.num_free_slots == 2
    manager.free("p#1")
    manager.check_integrity()
    assert pool.num_free_slots == 3


def test_hybrid_fork_needs_a_free_slot() -> None:
    manager = KVCacheManagerV1(HYBRID, 11, 4, 1)
    prefilled(manager)
    assert not manager.fork("p", "p#1", 10)
    manager.check_integrity()


def test_integrity_still_flags_a_block_shared_outside_a_fork() -> None:
    manager = KVCacheManagerV1(DENSE, 11, 4)
    prefilled(manager)
    assert manager.allocate_slots("q", 4)
    state = manager._requests["q"]
    manager._pool.release(state.blocks)
    manager._pool.touch([manager._requests["p"].blocks[1]])
    state.blocks[0] = manager._requests["p"].blocks[1]
    state.block_ids[0] = state.blocks[0].block_id
    with pytest.raises(Exception, match="owned by 2 tables"):
        manager.check_integrity()
