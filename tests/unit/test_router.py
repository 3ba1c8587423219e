"""Routing policies over the router's bookkeeping (pure Python)."""

from __future__ import annotations

import asyncio

import pytest

from cluster.metrics import ServingMetrics
from cluster.routing.policies import (
    LeastLoadedPolicy,
    NoWorkerError,
    PrefixAwarePolicy,
    PromptPrefix,
    RoundRobinPolicy,
    WorkerState,
    make_policy,
)
from cluster.routing.router import Router, RoutingSettings
from cluster.routing.worker_poller import SILENT, STEP_HUNG, UnresponsiveWorkerError, WorkerEndpoint
from engine.multimodal import EncoderCacheEvent, ImageInput
from kvcache.hashing import hash_full_blocks, hash_tail, root_hash
from kvcache.snapshots import SnapshotEvent, SnapshotEventKind


def _h(*ids: int) -> list[bytes]:
    """Stand-in block hashes: distinct byte strings per id."""
    return [i.to_bytes(8, "little") for i in ids]


def _pool(n: int) -> list[WorkerState]:
    return [WorkerState(name=f"w{i}") for i in range(n)]


def test_round_robin_cycles_and_skips_unhealthy() -> None:
    pool = _pool(3)
    policy = RoundRobinPolicy()
    assert [policy.choose(pool, []).name for _ in range(4)] == ["w0", "w1", "w2", "w0"]
    pool[1].healthy = False
    names = {policy.choose(pool, []).name for _ in range(4)}
    assert names == {"w0", "w2"}


def test_least_loaded_prefers_fewest_tokens_in_flight() -> None:
    pool = _pool(3)
    pool[0].tokens_in_flight = 500
    pool[1].tokens_in_flight = 20
    pool[2].tokens_in_flight = 300
    assert LeastLoadedPolicy().choose(pool, []).name == "w1"


def test_least_loaded_breaks_token_ties_by_queue_then_rotates() -> None:
    pool = _pool(3)
    pool[0].num_queued = 2
    policy = LeastLoadedPolicy()
    assert [policy.choose(pool, []).name for _ in range(4)] == ["w1", "w2", "w1", "w2"]


def test_prefix_aware_picks_the_worker_holding_the_longest_prefix() -> None:
    pool = _pool(3)
    pool[0].apply_kv_event(stored=_h(11), removed=[])
    pool[2].apply_kv_event(stored=_h(11, 12, 13), removed=[])
    pool[2].tokens_in_flight = 1000  # a longer match outweighs load
    assert PrefixAwarePolicy().choose(pool, _h(11, 12, 13, 14)).name == "w2"


def test_prefix_match_stops_at_the_first_missing_block() -> None:
    worker = WorkerState(name="w", cached_blocks=set(_h(1, 3, 4)))
    assert worker.prefix_match(_h(1, 2, 3, 4)) == 1
    assert worker.prefix_match(_h(2, 3, 4)) == 0


def test_prefix_aware_forgets_removed_blocks() -> None:
    pool = _pool(2)
    pool[1].apply_kv_event(stored=_h(5, 6), removed=[])
    pool[1].apply_kv_event(stored=_h(), removed=_h(5))
    pool[0].tokens_in_flight = 10
    # w1 no longer holds the first block: no match anywhere, least loaded wins.
    assert PrefixAwarePolicy().choose(pool, _h(5, 6)).name == "w1"
    pool[1].tokens_in_flight = 50
    assert PrefixAwarePolicy().choose(pool, _h(5, 6)).name == "w0"


def test_prefix_aware_ties_go_to_least_loaded_then_rotate() -> None:
    pool = _pool(3)
    for worker in pool[:2]:
        worker.apply_kv_event(stored=_h(1, 2), removed=[])
    pool[0].tokens_in_flight = 7
    policy = PrefixAwarePolicy()
    assert policy.choose(pool, _h(1, 2)).name == "w1"
    pool[0].tokens_in_flight = 0
    assert {policy.choose(pool, _h(1, 2)).name for _ in range(2)} == {"w0", "w1"}


@pytest.mark.parametrize("name", ["round_robin", "least_loaded", "prefix_aware"])
def test_every_policy_refuses_an_all_unhealthy_pool(name: str) -> None:
    pool = _pool(2)
    for worker in pool:
        worker.healthy = False
    with pytest.raises(NoWorkerError, match="no healthy worker"):
        make_policy(name).choose(pool, [])


def test_make_policy_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("random")


def _router(max_local: int, block_size: int = 4) -> Router:
    """A router over worker states only; the decisions tested here send nothing."""
    settings = RoutingSettings(
        policy="least_loaded",
        max_local_prefill_length=max_local,
        context_block_size=block_size,
        generation_block_size=block_size,
    )
    context = [WorkerEndpoint("context-0", None, WorkerState("context-0"))]
    generation = [
        WorkerEndpoint(f"generation-{i}", None, WorkerState(f"generation-{i}")) for i in range(2)
    ]
    return Router(context, generation, settings, ServingMetrics())


def test_conditional_disaggregation_runs_short_prompts_locally() -> None:
    router = _router(max_local=6)
    short, long = list(range(6)), list(range(7))
    assert router.runs_locally(short, router.block_hashes(short, 4))
    assert not router.runs_locally(long, router.block_hashes(long, 4))
    assert not _router(max_local=0).runs_locally([1], [])


def test_conditional_disaggregation_counts_only_the_uncached_part() -> None:
    router = _router(max_local=4)
    prompt = list(range(12))  # three full blocks of 4
    hashes = router.block_hashes(prompt, 4)
    assert len(hashes) == 3 and not router.runs_locally(prompt, hashes)
    # A generation worker holding the first two blocks leaves 4 uncached tokens.
    router.generation[1].state.apply_kv_event(stored=hashes[:2], removed=[])
    assert router.runs_locally(prompt, hashes)


def test_block_hashes_chain_over_the_prefix() -> None:
    router = _router(max_local=0)
    a = router.block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = router.block_hashes([1, 2, 3, 4, 0, 6, 7, 8], 4)
    assert len(a) == 2  # the partial third block is not hashed
    assert a[0] == b[0] and a[1] != b[1]


def test_block_hashes_differ_by_image_and_match_for_the_same_image() -> None:
    """Same placeholder tokens, other image: every block from the image on
    differs; the same image gives the same hashes, so prefix_aware routes the
    repeat where the first one's blocks are."""
    router = _router(max_local=0)
    prompt = [1, 2, 6, 6, 6, 6, 7, 8, 9, 10, 11, 12]
    cat = (ImageInput(b"c" * 32, b"png bytes", (4, 4), offset=2, num_tokens=4),)
    dog = (ImageInput(b"d" * 32, b"png bytes", (4, 4), offset=2, num_tokens=4),)
    with_cat = router.block_hashes(prompt, 4, cat)
    with_dog = router.block_hashes(prompt, 4, dog)
    assert all(a != b for a, b in zip(with_cat, with_dog, strict=True))
    assert with_cat == router.block_hashes(prompt, 4, cat)
    assert with_cat != router.block_hashes(prompt, 4)
    pool = _pool(2)
    pool[1].apply_kv_event(stored=with_cat, removed=[])
    assert PrefixAwarePolicy().choose(pool, with_cat).name == "w1"
    assert PrefixAwarePolicy().choose(pool, with_dog).name == "w0"


def test_prefix_aware_sends_an_image_to_the_worker_that_encoded_it() -> None:
    """With block reuse off (hybrid models) no KV event names a block; the
    encoder-cache events still point a repeated image at its encoder."""
    pool = _pool(3)
    cat, dog = b"c" * 32, b"d" * 32
    pool[2].apply_encoder_events([EncoderCacheEvent(True, cat)])
    pool[2].tokens_in_flight = 100  # a cached image outweighs load
    policy = PrefixAwarePolicy()
    assert policy.choose(pool, [], [cat]).name == "w2"
    assert policy.choose(pool, [], [dog]).name in {"w0", "w1"}
    # A longer cached KV prefix still comes first.
    pool[0].apply_kv_event(stored=_h(1), removed=[])
    assert policy.choose(pool, _h(1), [cat]).name == "w0"
    pool[2].apply_encoder_events([EncoderCacheEvent(False, cat)])
    assert policy.choose(pool, [], [cat]).name != "w2"


def test_encoder_events_apply_in_order() -> None:
    worker = WorkerState(name="w")
    cat = b"c" * 32
    worker.apply_encoder_events([EncoderCacheEvent(True, cat), EncoderCacheEvent(False, cat)])
    assert worker.image_match([cat]) == 0
    worker.apply_encoder_events([EncoderCacheEvent(False, cat), EncoderCacheEvent(True, cat)])
    assert worker.image_match([cat, cat, b"d" * 32]) == 2


async def test_a_worker_stalled_past_the_stall_timeout_has_its_requests_moved() -> None:
    router = _router(max_local=0)
    context, generation = router.context[0], router.generation[0]
    never: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    prefill = asyncio.ensure_future(router._context.answer(context, never))
    queue = router._channels[generation.name]._demux.open("streaming")
    router._channels[generation.name]._submitted_to["streaming"] = "incarnation-1"
    await asyncio.sleep(0.01)
    router._stalled(context, 29.0, SILENT)  # under the default 30 s: still waiting
    router._stalled(generation, 29.0, STEP_HUNG)
    await asyncio.sleep(0.01)
    assert not prefill.done() and queue.empty()
    router._stalled(context, 31.0, SILENT)
    router._stalled(generation, 31.0, STEP_HUNG)
    with pytest.raises(UnresponsiveWorkerError, match="context-0 answered nothing for 31 s"):
        await asyncio.wait_for(prefill, 5)
    failure = queue.get_nowait()
    assert isinstance(failure, UnresponsiveWorkerError)
    assert "generation-0 has computed one engine step for 31 s" in str(failure)


def _snapshot(
    kind: SnapshotEventKind, key: bytes, num_tokens: int, anchor: bytes = b"", tail: int = 0
) -> SnapshotEvent:
    return SnapshotEvent(kind, key, num_tokens, anchor, tail)


def test_a_hybrid_worker_skips_only_up_to_its_furthest_usable_snapshot() -> None:
    root = root_hash("")
    prompt = list(range(1, 15))  # 3 full blocks of 4, then 2 tokens
    hashes = hash_full_blocks(prompt, 4, root)
    worker = WorkerState("w0", block_size=4, hybrid=True)
    worker.apply_kv_event(hashes, [])
    assert (
        worker.prefix_match(PromptPrefix(hashes, prompt, 4, root)) == 0
    )  # KV alone resumes nothing
    worker.apply_snapshot_events([_snapshot("snapshot_stored", hashes[1], 8)])
    assert worker.prefix_match(PromptPrefix(hashes, prompt, 4, root)) == 8
    # A tail snapshot one token into block 3, on a cached partial block.
    tail_key = hash_tail(hashes[2], 3, 4, prompt[12:13])
    worker.apply_kv_event([tail_key], [])
    worker.apply_snapshot_events([_snapshot("snapshot_stored", tail_key, 13, hashes[2], 1)])
    assert worker.prefix_match(PromptPrefix(hashes, prompt, 4, root)) == 13
    other = prompt[:12] + [99, 98]  # same blocks, another tail
    assert worker.prefix_match(PromptPrefix(hashes, other, 4, root)) == 8
    # The tail's block evicted: the snapshot no longer counts.
    worker.apply_kv_event([], [tail_key])
    assert worker.prefix_match(PromptPrefix(hashes, prompt, 4, root)) == 8
    worker.apply_snapshot_events([_snapshot("snapshot_removed", hashes[1], 8)])
    assert worker.prefix_match(PromptPrefix(hashes, prompt, 4, root)) == 0


def test_prefix_aware_prefers_the_worker_that_resumes_further_not_the_one_with_more_kv() -> None:
    root = root_hash("")
    prompt = list(range(1, 15))
    hashes = hash_full_blocks(prompt, 4, root)
    more_kv = WorkerState("w0", block_size=4, hybrid=True)
    more_kv.apply_kv_event(hashes, [])
    more_kv.apply_snapshot_events([_snapshot("snapshot_stored", hashes[0], 4)])
    snapshot = WorkerState("w1", block_size=4, hybrid=True)
    snapshot.apply_kv_event(hashes[:2], [])
    snapshot.apply_snapshot_events([_snapshot("snapshot_stored", hashes[1], 8)])
    prefix = PromptPrefix(hashes, prompt, 4, root)
    assert PrefixAwarePolicy().choose([more_kv, snapshot], prefix).name == "w1"


def test_a_sequence_that_ended_counts_at_once_until_reports_confirm_or_drop_it() -> None:
    root = root_hash("")
    tokens = list(range(1, 12))  # 2 full blocks of 4, and 3 tokens
    prefix = PromptPrefix(hash_full_blocks(tokens, 4, root), tokens, 4, root)
    worker = WorkerState("w0", block_size=4, hybrid=True)
    worker.expect_sequence(prefix, 10)  # the last token was never fed back
    turn2 = tokens[:10] + [50, 51, 52, 53]
    next_prefix = PromptPrefix(hash_full_blocks(turn2, 4, root), turn2, 4, root)
    assert worker.prefix_match(next_prefix) == 10
    # A report confirms the blocks and the snapshot: they outlive the expiry.
    tail_key = hash_tail(prefix[1], 2, 4, tokens[8:10])
    worker.apply_kv_event([*prefix[:2], tail_key], [])
    worker.apply_snapshot_events([_snapshot("snapshot_stored", tail_key, 10, prefix[1], 2)])
    for _ in range(3):
        worker.end_poll()
    assert worker.prefix_match(next_prefix) == 10
    # Unconfirmed expectations go after two reports.
    other = WorkerState("w1", block_size=4, hybrid=True)
    other.expect_sequence(prefix, 10)
    other.end_poll()
    assert other.prefix_match(next_prefix) == 10
    other.end_poll()
    assert other.prefix_match(next_prefix) == 0 and not other.cached_blocks
