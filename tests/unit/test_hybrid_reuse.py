"""Hybrid prefix reuse bookkeeping on exact ids: the snapshot store, and the
V2 manager's resumes, snapshot points, copies and evictions.

Block size 4; a manager of 2 running Mamba slots (ids 0, 1) and 2 snapshot
slots (ids 2, 3). Every test ends with the manager's integrity check.
"""

from __future__ import annotations

import pytest

from kvcache.factory import create_manager
from kvcache.hashing import hash_block, root_hash
from kvcache.manager import KVCacheManager
from kvcache.snapshots import SnapshotPolicy, SnapshotStore
from kvcache.spec import CacheSpec

BS = 4
HYBRID = CacheSpec(
    num_kv_heads=2,
    head_dim=4,
    attention_layers=(1,),
    mamba_layers=(0, 2),
    conv_state_shape=(6, 3),
    ssm_state_shape=(2, 4, 5),
)
PROMPT = list(range(100, 110))  # 2 full blocks + 2 tokens
ROOT = root_hash("m")


def manager(num_blocks: int = 17, **policy: object) -> KVCacheManager:
    snapshots = SnapshotPolicy(**{"num_slots": 2, **policy})  # type: ignore[arg-type]
    return create_manager(
        "v2",
        HYBRID,
        num_blocks,
        BS,
        2,
        enable_block_reuse=True,
        hash_namespace="m",
        snapshots=snapshots,
    )


def chain(tokens: list[int]) -> list[bytes]:
    hashes, parent = [], ROOT
    for i in range(len(tokens) // BS):
        parent = hash_block(parent, tokens[i * BS : (i + 1) * BS])
        hashes.append(parent)
    return hashes


def run_to_end(m: KVCacheManager, rid: str, tokens: list[int], computed: int) -> list[int]:
    """Prefill `computed` tokens of `tokens` in one step and free the request."""
    assert m.allocate_slots(rid, computed, tokens[:computed])
    table = list(m.block_table(rid))
    m.take_copies()
    m.step_done()
    m.free(rid)
    return table


def test_a_finished_sequence_leaves_its_slot_as_a_tail_snapshot_and_the_next_turn_resumes() -> None:
    m = manager()
    assert m.allocate_slots("a", 10, PROMPT)
    table_a, slot_a = list(m.block_table("a")), m.mamba_slot("a")
    assert (table_a, slot_a) == ([1, 2, 3], 0)
    m.take_copies()
    m.step_done()
    m.free("a")
    store = m.hybrid_reuse.store
    tail_key = hash_block(chain(PROMPT)[-1], PROMPT[8:10])
    snap = store.get(tail_key)
    assert snap is not None and (snap.num_tokens, snap.slot, snap.tail) == (10, 0, (108, 109))
    # The running pool got a snapshot slot in exchange; slot 0 now holds the snapshot.
    assert sorted(m.mamba_pool.free_slots()) == [1, 3]
    m.check_integrity()

    turn2 = PROMPT + [7, 8, 9, 10, 11]
    assert m.match_prefix("b", turn2) == 10
    table_b = list(m.block_table("b"))
    assert table_b[:2] == table_a[:2] and table_b[2] not in table_a
    copies = m.take_copies()
    assert copies.slot_loads == [(0, m.mamba_slot("b"))]
    # The partial block's KV goes into b's own block.
    assert copies.block_loads == [(table_a[2], table_b[2])]
    assert store.get(tail_key).pins == 1
    m.step_done()
    assert store.get(tail_key).pins == 0
    assert m.hybrid_reuse.store.hits == 1
    m.check_integrity()


def test_a_shared_prefix_gets_an_on_demand_snapshot_and_hits_from_the_third_request() -> None:
    m = manager(at_end=False)
    system = list(range(1, 9))  # two full blocks
    run_to_end(m, "a", system + [50, 51, 52], 11)
    assert m.match_prefix("b", system + [60, 61, 62]) == 0  # KV cached, no snapshot yet
    assert m.chunk_limit("b", 0, 11) == 8  # the chunk stops at the shared boundary
    assert m.allocate_slots("b", 8, (system + [60, 61, 62])[:8])
    copies = m.take_copies()
    assert copies.slot_saves == [(m.mamba_slot("b"), 3)]
    key = chain(system)[-1]
    assert not m.hybrid_reuse.store.get(key).ready  # written by the step, not before
    m.step_done()
    assert m.hybrid_reuse.store.get(key).ready
    m.free("b")
    assert m.match_prefix("c", system + [70, 71, 72]) == 8
    assert m.take_copies().slot_loads == [(3, m.mamba_slot("c"))]
    m.step_done()
    m.check_integrity()


def test_periodic_points_end_chunks_and_fixed_positions_too() -> None:
    m = manager(interval=8, positions=(4,), at_end=False, on_demand=False)
    assert m.chunk_limit("a", 0, 10) == 4
    assert m.chunk_limit("a", 4, 10) == 4
    assert m.chunk_limit("a", 8, 10) == 8
    assert m.chunk_limit("a", 9, 1) == 1
    assert m.allocate_slots("a", 4, PROMPT[:4])
    assert m.take_copies().slot_saves == [(0, 3)]
    m.step_done()
    m.check_integrity()


def test_a_request_preempted_before_its_step_ran_withdraws_blocks_and_keeps_what_ran() -> None:
    m = manager()
    assert m.allocate_slots("a", 4, PROMPT[:4])
    m.take_copies()
    m.step_done()
    # The next step allocates two more blocks, then the request is preempted
    # while that step is built: only its first 4 tokens were computed.
    assert m.allocate_slots("a", 12, (PROMPT + [1, 2])[:12])
    hashes = chain(PROMPT + [1, 2])
    assert m._pool.lookup(hashes[2]) is not None
    m.free("a", num_computed=4)
    assert m._pool.lookup(hashes[1]) is None and m._pool.lookup(hashes[2]) is None
    snap = m.hybrid_reuse.store.get(hashes[0])
    assert snap is not None and snap.num_tokens == 4 and snap.ready
    m.check_integrity()


def test_a_resume_planned_for_a_request_that_never_ran_is_undone() -> None:
    m = manager()
    run_to_end(m, "a", PROMPT, 10)
    store = m.hybrid_reuse.store
    assert m.match_prefix("b", PROMPT + [5]) == 10
    m.free("b", num_computed=10)  # aborted before any step
    assert all(snap.pins == 0 for snap in store._by_key.values())
    assert m.take_copies().slot_loads == []
    assert len(store) == 1  # no snapshot of a slot that never held the state
    m.check_integrity()


def test_evicting_a_block_drops_the_snapshots_standing_on_it() -> None:
    m = manager(num_blocks=5)  # 4 usable blocks
    run_to_end(m, "a", PROMPT, 10)
    store = m.hybrid_reuse.store
    assert len(store) == 1
    # A new request takes every block: a's cached blocks are evicted.
    assert m.allocate_slots("b", 16, list(range(300, 316)))
    assert len(store) == 0 and store.dropped == 1
    assert m.match_prefix("c", PROMPT + [1]) == 0
    m.check_integrity()


def test_the_store_evicts_its_least_recently_used_unpinned_snapshot() -> None:
    store = SnapshotStore([7, 8])
    a = store.add(b"a", 4, store.reserve(), [b"a"], ready=True)
    b = store.add(b"b", 8, store.reserve(), [b"x", b"b"], ready=True)
    assert store.best([ROOT, b"a"], [0] * 5, BS, 4, lambda *_: b"") is a  # a is now newest
    store.pin(a)
    slot = store.reserve()
    assert slot == b.slot and b"b" not in store and store.evictions == 1
    store.add(b"c", 4, slot, [b"c"])  # not ready: not evictable either
    assert store.reserve() is None  # a is pinned, c not written yet
    store.drop_block(b"a")  # pinned: kept until unpinned, but no longer usable
    assert store.best([ROOT, b"a"], [0] * 5, BS, 4, lambda *_: b"") is None
    store.unpin(a)
    assert b"a" not in store and store.dropped == 1
    store.check_integrity()


def test_reuse_stays_off_for_a_hybrid_model_without_snapshot_slots() -> None:
    m = create_manager(
        "v2", HYBRID, 17, BS, 2, enable_block_reuse=True, snapshots=SnapshotPolicy(num_slots=0)
    )
    assert not m.enable_block_reuse and m.hybrid_reuse is None
    assert m.layout.num_slots == 2


def test_snapshot_points_off_the_block_grid_are_refused() -> None:
    with pytest.raises(ValueError, match="multiples of the block size"):
        manager(interval=6)


def test_only_the_first_request_at_a_shared_boundary_stops_its_chunk_there() -> None:
    m = manager(at_end=False)
    system = list(range(1, 9))
    run_to_end(m, "a", system + [50, 51, 52], 11)
    assert m.match_prefix("b", system + [60, 61, 62]) == 0
    assert m.match_prefix("c", system + [70, 71, 72]) == 0
    assert m.chunk_limit("b", 0, 11) == 8 and m.chunk_limit("c", 0, 11) == 8
    assert m.allocate_slots("b", 8, (system + [60, 61, 62])[:8])
    # b's save is planned: c computes its whole prompt in one chunk.
    assert m.chunk_limit("c", 0, 11) == 11
    m.take_copies()
    m.step_done()
    m.free("b")
    m.free("c")
    m.check_integrity()
