"""Prompt progress on the context side, over a real V1 manager (no torch)."""

from __future__ import annotations

import asyncio

from engine.request import Request
from engine.sampling import SamplingParams
from engine.step_event import HostEvent
from kvcache.manager_v1 import KVCacheManagerV1
from kvcache.spec import CacheSpec
from prefill_worker.chunk_progress import ChunkProgress
from tests.step_events import GatedEvent

DENSE = CacheSpec(num_kv_heads=2, head_dim=4, attention_layers=(0, 1))


def _prefilling(manager: KVCacheManagerV1, rid: str, computed: int, total: int) -> Request:
    request = Request(rid, list(range(total)), SamplingParams(max_tokens=1))
    assert manager.allocate_slots(rid, computed)
    request.num_computed_tokens = computed
    return request


def test_only_full_blocks_of_wanted_prompts_are_final_and_held() -> None:
    manager = KVCacheManagerV1(DENSE, num_blocks=11, block_size=4)
    progress = ChunkProgress(manager)
    wanted = _prefilling(manager, "wanted", 10, 20)
    other = _prefilling(manager, "other", 8, 20)
    progress.get("wanted").wanted = True
    assert progress.on_step([wanted, other], [], HostEvent()) == []
    # 10 tokens: blocks 0 and 1 are final, block 2 still takes tokens 8..11.
    assert progress.get("wanted").block_ids == tuple(manager.block_table("wanted")[:2])
    assert progress.get("wanted").answers(0) and not progress.get("wanted").answers(2)
    assert progress.get("other").block_ids == ()  # nobody asked: nothing held
    manager.free("other")
    assert manager.num_held_blocks == 0
    manager.check_integrity()


def test_a_preempted_prompt_is_withdrawn_and_keeps_its_blocks_until_released() -> None:
    manager = KVCacheManagerV1(DENSE, num_blocks=11, block_size=4)
    progress = ChunkProgress(manager)
    request = _prefilling(manager, "p", 12, 20)
    progress.get("p").wanted = True
    progress.on_step([request], [], HostEvent())
    offered = manager.block_table("p")
    manager.free("p")  # the scheduler preempts it
    assert manager.num_held_blocks == 3 and manager.num_free_blocks == 7
    manager.check_integrity()
    assert progress.on_step([], [request], HostEvent()) == ["p"]
    assert progress.get("p").withdrawn and progress.get("p").answers(5)
    # It runs again on other blocks; the offered ones come back only now.
    assert manager.allocate_slots("p", 4)
    assert not set(manager.block_table("p")) & set(offered)
    manager.release_hold("p")
    assert manager.num_held_blocks == 0 and manager.num_free_blocks == 9
    manager.check_integrity()


async def test_blocks_are_settled_only_once_the_step_that_wrote_them_is_done() -> None:
    """A step still running on the device holds its blocks back; a later step
    that extends them while the first is awaited is waited for too."""
    manager = KVCacheManagerV1(DENSE, num_blocks=11, block_size=4)
    progress = ChunkProgress(manager)
    request = _prefilling(manager, "p", 4, 20)
    prompt = progress.get("p")
    prompt.wanted = True
    first, second = GatedEvent(), GatedEvent()
    progress.on_step([request], [], first)
    settling = asyncio.ensure_future(progress.settled(prompt))
    await asyncio.sleep(0.05)
    assert not settling.done() and first.waited
    assert manager.allocate_slots("p", 8)
    request.num_computed_tokens = 8
    progress.on_step([request], [], second)  # the next step, still running too
    first.complete()
    await asyncio.sleep(0.05)
    assert not settling.done()
    second.complete()
    await asyncio.wait_for(settling, 5)
    assert prompt.num_ready == 2 and prompt.written is second


async def test_settling_finished_steps_does_not_yield() -> None:
    manager = KVCacheManagerV1(DENSE, num_blocks=11, block_size=4)
    progress = ChunkProgress(manager)
    prompt = progress.get("p")
    steps = progress.settled(prompt)
    try:
        steps.send(None)
    except StopIteration:
        pass
    else:
        raise AssertionError("settled yielded for a finished step")
