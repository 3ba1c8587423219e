"""Manager V2 prefix reuse on an 11-block pool (10 usable, 4 tokens per block)."""

from __future__ import annotations

import logging

import pytest

from engine.multimodal import ImageInput
from kvcache import resolution
from kvcache.errors import RequestStateError
from kvcache.events import BLOCK_REMOVED, BLOCK_STORED
from kvcache.hashing import hash_full_blocks, root_hash, span_keys
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


@pytest.fixture
def manager() -> KVCacheManagerV2:
    return KVCacheManagerV2(DENSE, 11, 4, enable_block_reuse=True, hash_namespace="m")


def run_prompt(manager: KVCacheManagerV2, request_id: str, tokens: list[int]) -> int:
    hit = manager.match_prefix(request_id, tokens)
    assert manager.allocate_slots(request_id, len(tokens), tokens)
    return hit


def test_second_request_reuses_the_full_blocks_of_the_first(manager: KVCacheManagerV2) -> None:
    assert run_prompt(manager, "a", PROMPT) == 0
    assert manager.block_table("a") == [1, 2, 3]
    stored = manager.drain_events()
    hashes = hash_full_blocks(PROMPT, 4, root_hash("m"))
    assert [(e.kind, e.block_id, e.block_hash) for e in stored] == [
        (BLOCK_STORED, 1, hashes[0]),
        (BLOCK_STORED, 2, hashes[1]),
    ]
    assert stored[1].parent_hash == hashes[0]
    assert run_prompt(manager, "b", PROMPT + [7]) == 8
    assert manager.block_table("b") == [1, 2, 4]
    assert manager.prefix_queries == 21 and manager.prefix_hits == 8
    manager.check_integrity()


def test_match_revives_freed_blocks_and_leaves_one_token(manager: KVCacheManagerV2) -> None:
    run_prompt(manager, "a", PROMPT[:8] + [1, 2, 3, 4])  # three full blocks
    manager.free("a")
    assert manager.free_queue_ids() == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    # Exactly two blocks of prompt: the last token must be computed, so one block.
    assert manager.match_prefix("b", PROMPT[:8]) == 4
    assert manager.block_table("b") == [1]
    assert manager.free_queue_ids() == [4, 5, 6, 7, 8, 9, 10, 3, 2]
    assert manager.allocate_slots("b", 8, PROMPT[:8])
    assert manager.block_table("b") == [1, 4]
    manager.check_integrity()


def test_lru_eviction_takes_the_tail_of_the_oldest_chain_first(manager: KVCacheManagerV2) -> None:
    run_prompt(manager, "a", PROMPT[:8] + [0])  # blocks 1, 2 published, 3 partial
    manager.free("a")
    manager.drain_events()
    assert manager.free_queue_ids() == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    assert manager.allocate_slots("big", 36)  # 9 blocks: takes 4..10, 3, then evicts 2
    assert manager.block_table("big") == [2, 3, 4, 5, 6, 7, 8, 9, 10]  # in id order
    assert manager.evictions == 1
    assert [(e.kind, e.block_id) for e in manager.drain_events()] == [(BLOCK_REMOVED, 2)]
    # The head of the chain survived: a new request still hits block 1.
    assert manager.match_prefix("c", PROMPT[:8] + [0]) == 4
    assert manager.block_table("c") == [1]
    manager.check_integrity()


def test_shared_blocks_are_counted_once_and_freed_by_the_last_owner(
    manager: KVCacheManagerV2,
) -> None:
    run_prompt(manager, "a", PROMPT)
    run_prompt(manager, "b", PROMPT)
    assert manager.num_free_blocks == 6
    manager.free("a")
    assert manager.free_queue_ids() == [5, 6, 7, 8, 9, 10, 3]
    manager.free("b")
    assert manager.free_queue_ids() == [5, 6, 7, 8, 9, 10, 3, 4, 2, 1]
    manager.check_integrity()


def test_transferred_blocks_are_published_only_when_the_transfer_finishes(
    manager: KVCacheManagerV2,
) -> None:
    assert manager.allocate_for_transfer("t", 10)
    assert manager.match_prefix("probe", PROMPT) == 0
    manager.finish_transfer("t", PROMPT + [55])  # the sampled token has no KV yet
    assert [e.block_id for e in manager.drain_events()] == [1, 2]
    assert manager.match_prefix("probe2", PROMPT) == 8
    manager.check_integrity()


def test_aborted_transfer_publishes_nothing(manager: KVCacheManagerV2) -> None:
    assert manager.allocate_for_transfer("t", 10)
    manager.free("t")
    assert manager.drain_events() == []
    assert manager.match_prefix("probe", PROMPT) == 0
    assert manager.free_queue_ids() == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    manager.check_integrity()


def test_match_prefix_needs_a_request_without_blocks(manager: KVCacheManagerV2) -> None:
    run_prompt(manager, "a", PROMPT)
    with pytest.raises(RequestStateError, match="already holds blocks"):
        manager.match_prefix("a", PROMPT)


def test_reuse_is_opt_in() -> None:
    manager = KVCacheManagerV2(DENSE, 11, 4)
    run_prompt(manager, "a", PROMPT)
    manager.free("a")
    assert manager.match_prefix("b", PROMPT) == 0
    assert manager.drain_events() == []


def test_hybrid_model_keeps_reuse_off_and_says_why(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resolution, "_logged", set())
    with caplog.at_level(logging.INFO, logger="kvcache.resolution"):
        manager = KVCacheManagerV2(HYBRID, 11, 4, 2, enable_block_reuse=True)
        KVCacheManagerV2(HYBRID, 11, 4, 2, enable_block_reuse=True)
    assert not manager.enable_block_reuse
    assert caplog.text.count("Mamba state snapshot") == 1
    run_prompt(manager, "a", PROMPT)
    assert manager.mamba_slot("a") == 0
    manager.free("a")
    assert manager.match_prefix("b", PROMPT) == 0
    manager.check_integrity()


IMAGE_TOKEN = 6


def image(tag: bytes, offset: int, num_tokens: int) -> ImageInput:
    return ImageInput(content_hash=tag * 32, offset=offset, num_tokens=num_tokens)


def test_same_text_with_another_image_never_shares_blocks(manager: KVCacheManagerV2) -> None:
    """Blocks 0 and 1 hold placeholders of the image; block 2 follows it. Only
    the same image (and text) reuses them, and the events carry those hashes."""
    prompt = [100, 101, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, 105, 106, 107, 108, 109, 110, 111, 1]
    cat, dog = (image(b"c", 2, 3),), (image(b"d", 2, 3),)
    assert manager.match_prefix("a", prompt, cat) == 0
    assert manager.allocate_slots("a", len(prompt), prompt, cat)
    stored = [e.block_hash for e in manager.drain_events()]
    assert stored == hash_full_blocks(prompt, 4, root_hash("m"), spans=cat)
    assert stored != hash_full_blocks(prompt, 4, root_hash("m"))
    assert manager.match_prefix("b", prompt, dog) == 0
    manager.free("b")
    assert manager.match_prefix("c", prompt, cat) == 12
    manager.check_integrity()


def test_block_keys_name_the_images_overlapping_each_block() -> None:
    spans = (image(b"a", 2, 3), image(b"b", 5, 6))
    assert span_keys(0, 4, spans) == (b"a" * 32,)
    assert span_keys(1, 4, spans) == (b"a" * 32, b"b" * 32)
    assert span_keys(2, 4, spans) == (b"b" * 32,)
    assert span_keys(3, 4, spans) == ()
