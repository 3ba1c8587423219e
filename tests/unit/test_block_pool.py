"""Block pool, free queue and block hashing on an 11-block pool (10 usable)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvcache.block_pool import NULL_BLOCK_ID, BlockPool
from kvcache.errors import IntegrityError
from kvcache.events import BLOCK_REMOVED, BLOCK_STORED
from kvcache.free_queue import FreeBlockQueue
from kvcache.hashing import hash_block, hash_full_blocks, root_hash

ROOT = root_hash("test")


def ids(blocks: list) -> list[int]:
    return [b.block_id for b in blocks]


def test_fresh_pool_queues_every_block_but_the_null_block_in_order() -> None:
    pool = BlockPool(11)
    assert pool.free_queue.ids() == list(range(1, 11))
    assert pool.num_free_blocks == pool.num_usable_blocks == 10
    pool.check_integrity()


def test_allocate_takes_from_the_front_and_release_appends_in_given_order() -> None:
    pool = BlockPool(11)
    a = pool.allocate(3)
    assert ids(a) == [1, 2, 3]
    b = pool.allocate(2)
    assert ids(b) == [4, 5]
    assert pool.free_queue.ids() == [6, 7, 8, 9, 10]
    pool.release(a[::-1])
    assert pool.free_queue.ids() == [6, 7, 8, 9, 10, 3, 2, 1]
    # The queue decides which blocks (its front six); they come back in id order.
    assert ids(pool.allocate(6)) == [3, 6, 7, 8, 9, 10]
    assert pool.free_queue.ids() == [2, 1]
    assert ids(pool.allocate(2)) == [1, 2]  # a tail-first release reads forwards again
    pool.check_integrity()


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(11)
    taken = pool.allocate(10)
    assert NULL_BLOCK_ID not in ids(taken)
    with pytest.raises(ValueError, match="cannot allocate 1 blocks, 0 free"):
        pool.allocate(1)
    with pytest.raises(ValueError):
        pool.release([pool.null_block])


def test_touch_revives_a_cached_block_from_the_middle_of_the_queue() -> None:
    pool = BlockPool(11)
    blocks = pool.allocate(3)
    h1 = hash_block(ROOT, [1, 2])
    assert pool.publish(blocks[1], h1, ROOT)
    pool.release(blocks[::-1])
    assert pool.free_queue.ids() == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    hit = pool.lookup(h1)
    assert hit is not None and hit.block_id == 2
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.free_queue.ids() == [4, 5, 6, 7, 8, 9, 10, 3, 1]
    pool.check_integrity()


def test_allocating_a_cached_block_evicts_it_and_reports_both_events() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    h = hash_block(ROOT, [7])
    pool.publish(blocks[0], h, ROOT)
    assert not pool.publish(blocks[1], h, ROOT), "one block per hash"
    pool.release(blocks[::-1])
    assert pool.free_queue.ids() == [2, 1]
    assert ids(pool.allocate(2)) == [1, 2]  # both taken, handed out in id order
    assert pool.lookup(h) is None and pool.num_evictions == 1
    events = pool.events.drain()
    assert [(e.kind, e.block_id, e.block_hash) for e in events] == [
        (BLOCK_STORED, 1, h),
        (BLOCK_REMOVED, 1, h),
    ]
    assert pool.events.drain() == []
    pool.check_integrity()


def test_integrity_check_reports_a_wrong_ref_count_and_a_lost_block() -> None:
    pool = BlockPool(11)
    blocks = pool.allocate(2)
    blocks[0].ref_cnt = 0  # released without returning to the queue
    with pytest.raises(IntegrityError, match="block 1 has no owner and is not queued"):
        pool.check_integrity()


def test_free_queue_remove_from_middle_and_reject_double_insert() -> None:
    pool = BlockPool(6)
    queue: FreeBlockQueue = pool.free_queue
    queue.remove(pool.blocks[3])
    assert queue.ids() == [1, 2, 4, 5] and len(queue) == 4
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(pool.blocks[1])
    queue.append(pool.blocks[3])
    assert queue.ids() == [1, 2, 4, 5, 3]
    assert queue.popleft().block_id == 1


def test_block_hash_chains_over_parent_tokens_and_extra_keys() -> None:
    tokens = list(range(12))
    hashes = hash_full_blocks(tokens + [99], 4, ROOT)
    assert len(hashes) == 3, "a trailing partial block is not hashed"
    assert hashes[1] == hash_block(hashes[0], tokens[4:8])
    assert hash_full_blocks(tokens, 4, hashes[0], start_block=1) == hashes[1:]
    assert hash_block(ROOT, [1, 2]) != hash_block(root_hash("other"), [1, 2])
    assert hash_block(ROOT, [1, 2], ("a",)) != hash_block(ROOT, [1, 2])
    assert hash_block(ROOT, [1], ("ab",)) != hash_block(ROOT, [1], ("a", "b"))


def test_block_hash_is_identical_in_another_process() -> None:
    code = "from kvcache.hashing import *; print(hash_block(root_hash('test'), [5, 6, 7]).hex())"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == hash_block(ROOT, [5, 6, 7]).hex()
