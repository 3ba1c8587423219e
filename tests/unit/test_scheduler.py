"""Scheduler against a real KV cache manager: budgets, chunking, preemption.

Pure Python: the "model" is simulated by committing each step and appending a
fixed token to every sequence that samples.
"""

from __future__ import annotations

import pytest

from engine.multimodal import ImageInput
from engine.request import FinishReason, Request, RequestStatus
from engine.scheduler import (
    PACED_BACKLOG,
    CapacityError,
    PromptPacing,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from kvcache.factory import create_manager
from kvcache.manager import KVCacheManager
from kvcache.spec import CacheSpec

DENSE = CacheSpec(num_kv_heads=1, head_dim=4, attention_layers=(0,))
HYBRID = CacheSpec(
    num_kv_heads=1,
    head_dim=4,
    attention_layers=(1,),
    mamba_layers=(0,),
    conv_state_shape=(8, 3),
    ssm_state_shape=(2, 2, 2),
)
BLOCK = 4
NEXT_TOKEN = 7


class Params:
    max_tokens = 100


def make(
    num_blocks: int,
    max_num_tokens: int = 64,
    max_batch_size: int = 8,
    manager: str = "v1",
    spec: CacheSpec = DENSE,
    slots: int = 0,
    reuse: bool = False,
) -> tuple[Scheduler, KVCacheManager]:
    mgr = create_manager(manager, spec, num_blocks, BLOCK, slots, enable_block_reuse=reuse)
    config = SchedulerConfig(
        max_num_tokens=max_num_tokens,
        max_batch_size=max_batch_size,
        max_model_tokens=mgr.num_usable_blocks * BLOCK,
        enable_prefix_match=reuse,
    )
    return Scheduler(config, mgr), mgr


def req(rid: str, n: int, first: int = 100) -> Request:
    return Request(rid, list(range(first, first + n)), Params())


def run_step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    samplers = [s.request for s in out.sequences if s.samples]
    sched.commit(out)
    for r in samplers:
        r.append_output(NEXT_TOKEN)
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(s.request.request_id, s.num_new_tokens, s.samples) for s in out.sequences]


def test_long_prompt_is_prefilled_in_chunks_and_samples_only_at_the_end() -> None:
    sched, _ = make(num_blocks=16, max_num_tokens=8)
    sched.add(req("a", 20))
    assert plan(run_step(sched)) == [("a", 8, False)]
    assert plan(run_step(sched)) == [("a", 8, False)]
    assert plan(run_step(sched)) == [("a", 4, True)]
    assert plan(run_step(sched)) == [("a", 1, True)]
    assert sched.running[0].output_token_ids == [NEXT_TOKEN, NEXT_TOKEN]


def test_decodes_go_first_and_prefill_takes_the_remaining_budget() -> None:
    sched, _ = make(num_blocks=32, max_num_tokens=10)
    sched.add(req("a", 3))
    run_step(sched)  # a prefilled, now decoding
    sched.add(req("b", 30))
    assert plan(run_step(sched)) == [("a", 1, True), ("b", 9, False)]
    assert plan(run_step(sched)) == [("a", 1, True), ("b", 9, False)]


def test_max_batch_size_caps_sequences_per_step() -> None:
    sched, _ = make(num_blocks=32, max_batch_size=2)
    for rid in "abc":
        sched.add(req(rid, 2))
    assert [s[0] for s in plan(run_step(sched))] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_running_out_of_blocks_preempts_the_newest_and_requeues_it_first() -> None:
    # 5 usable blocks of 4 tokens: two requests of 8 tokens fill 4 blocks.
    sched, mgr = make(num_blocks=6)
    sched.add(req("old", 8))
    sched.add(req("new", 8, first=300))
    sched.add(req("later", 2, first=500))
    run_step(sched)  # both prefilled (4 blocks), "later" takes the 5th
    assert mgr.num_free_blocks == 0
    out = run_step(sched)
    # "old" needs a 3rd block: "later", the newest, goes. Then "new" needs one
    # too and is itself the newest left, so it steps back as well.
    assert [r.request_id for r in out.preempted] == ["later", "new"]
    assert plan(out) == [("old", 1, True)]
    assert [r.request_id for r in sched.waiting] == ["new", "later"]
    later = sched.waiting[1]
    assert later.status is RequestStatus.PREEMPTED
    assert later.num_computed_tokens == 0 and later.num_preemptions == 1
    assert not mgr.has_request("later") and not mgr.has_request("new")
    mgr.check_integrity()


def test_preempted_request_resumes_with_prompt_and_outputs_recomputed() -> None:
    sched, mgr = make(num_blocks=5)  # 4 usable blocks = 16 tokens
    sched.add(req("a", 6))
    sched.add(req("b", 6, first=300))
    run_step(sched)  # a: 2 blocks, b: 2 blocks; both sampled one token
    run_step(sched)
    run_step(sched)  # 8 tokens each in cache -> both fit exactly
    out = run_step(sched)  # a needs a 3rd block: b is preempted
    assert [r.request_id for r in out.preempted] == ["b"]
    b = sched.waiting[0]
    assert b.num_output_tokens == 3
    # a runs alone until it finishes; then b is readmitted with all 8 tokens.
    a = sched.running[0]
    sched.remove(a)
    out = run_step(sched)
    assert plan(out) == [("b", 9, True)]
    assert b.status is RequestStatus.RUNNING
    mgr.check_integrity()


def pulled(rid: str, n: int, first: int) -> Request:
    """A request as a generation worker pulls it: its image without the bytes."""
    request = req(rid, n, first)
    request.images = (ImageInput(b"h" * 32, b"", (4, 4), offset=1, num_tokens=4),)
    return request


def test_preempted_request_with_pulled_images_is_handed_back() -> None:
    """A request whose images were encoded on a context worker holds only their
    hashes here: recomputing it would feed placeholder tokens without images,
    so it ends here for a new context prefill elsewhere."""
    sched, mgr = make(num_blocks=5)
    sched.add(pulled("a", 6, first=100))
    b = pulled("b", 6, first=300)
    sched.add(b)
    for _ in range(3):
        run_step(sched)
    out = run_step(sched)  # a needs a 3rd block: b, the newest, goes
    assert out.preempted == [] and out.failed == []
    assert [r.request_id for r in out.handed_back] == ["b"]
    assert b.finish_reason is FinishReason.PREEMPTED and b.error is None
    assert not mgr.has_request("b") and [r.request_id for r in sched.running] == ["a"]
    mgr.check_integrity()


def test_victims_that_can_be_recomputed_go_first() -> None:
    """The newest request is handed back only when no recomputable one is left:
    here the older, recomputable `b` is preempted so that `c` keeps its cache."""
    sched, mgr = make(num_blocks=7)  # 6 usable blocks = 24 tokens
    sched.add(req("a", 6))
    sched.add(req("b", 6, first=200))
    c = pulled("c", 6, first=300)
    sched.add(c)
    for _ in range(3):
        run_step(sched)  # 8 tokens each: every block in use
    out = run_step(sched)  # a needs a 3rd block
    assert [r.request_id for r in out.preempted] == ["b"] and out.handed_back == []
    assert [r.request_id for r in sched.running] == ["a", "c"]
    mgr.check_integrity()


def test_prompt_larger_than_the_whole_cache_is_rejected_with_a_clear_error() -> None:
    sched, _ = make(num_blocks=3)  # 8 tokens
    with pytest.raises(CapacityError, match="raise max_tokens"):
        sched.add(req("big", 9))


def test_request_outgrowing_the_cache_fails_instead_of_looping() -> None:
    sched, mgr = make(num_blocks=3)  # 2 usable blocks = 8 tokens
    sched.add(req("a", 7))
    run_step(sched)  # 7 computed + 1 sampled
    run_step(sched)  # 8 computed, 9 tokens known
    out = run_step(sched)
    assert [r.request_id for r in out.failed] == ["a"]
    a = out.failed[0]
    assert a.finish_reason is FinishReason.ERROR and "8 tokens" in (a.error or "")
    assert not sched.has_work() and not mgr.has_request("a")


def test_waiting_requests_wait_for_blocks_without_preempting() -> None:
    sched, mgr = make(num_blocks=4)  # 3 usable blocks
    sched.add(req("a", 8))
    run_step(sched)
    sched.add(req("b", 8, first=300))
    out = run_step(sched)
    assert plan(out) == [("a", 1, True)]
    assert [r.request_id for r in sched.waiting] == ["b"]
    sched.remove(sched.running[0])
    assert plan(run_step(sched)) == [("b", 8, True)]
    mgr.check_integrity()


def test_hybrid_requests_wait_for_a_free_mamba_slot() -> None:
    sched, mgr = make(num_blocks=16, spec=HYBRID, slots=1)
    sched.add(req("a", 4))
    sched.add(req("b", 4, first=300))
    assert plan(run_step(sched)) == [("a", 4, True)]
    assert mgr.mamba_slot("a") is not None and mgr.mamba_slot("b") is None
    sched.remove(sched.running[0])
    assert plan(run_step(sched)) == [("b", 4, True)]


def test_prefix_match_skips_cached_full_blocks_under_v2_reuse() -> None:
    sched, mgr = make(num_blocks=16, manager="v2", reuse=True)
    sched.add(req("a", 10))
    run_step(sched)
    sched.remove(sched.running[0])
    b = req("b", 10)
    sched.add(b)
    assert plan(run_step(sched)) == [("b", 2, True)]
    assert b.num_cached_tokens == 8
    mgr.check_integrity()


def test_token_ids_between_slices_prompt_and_output_as_one_sequence() -> None:
    req = Request("r", [1, 2, 3], Params())
    req.output_token_ids.extend([4, 5])
    whole = req.all_token_ids
    for start in range(6):
        for end in range(start, 6):
            assert req.token_ids_between(start, end) == whole[start:end]


# ---- prompt pacing ----------------------------------------------------------


def test_pacing_has_no_limit_until_a_prompt_step_was_observed() -> None:
    pacing = PromptPacing(target_s=0.1)
    assert pacing.admits(256, 256)
    pacing.observe(num_tokens=63, prompt_tokens=63, seconds=1.0)  # too few prompt tokens
    pacing.observe(num_tokens=200, prompt_tokens=80, seconds=1.0)  # mostly decodes
    assert pacing.seconds_per_token is None
    pacing.observe(num_tokens=100, prompt_tokens=64, seconds=0.1)
    assert pacing.seconds_per_token == pytest.approx(1e-3)


def test_pacing_drops_to_a_faster_step_at_once_and_rises_slowly() -> None:
    pacing = PromptPacing(target_s=0.1)
    pacing.observe(num_tokens=256, prompt_tokens=256, seconds=0.256)  # a cold first step
    pacing.observe(num_tokens=256, prompt_tokens=256, seconds=0.0256)
    assert pacing.seconds_per_token == pytest.approx(1e-4)
    pacing.observe(num_tokens=256, prompt_tokens=256, seconds=0.0512)  # one slow step
    assert pacing.seconds_per_token == pytest.approx(1.25e-4)


def test_pacing_admits_another_prompt_only_within_the_target() -> None:
    pacing = PromptPacing(target_s=0.1)
    pacing.observe(num_tokens=256, prompt_tokens=256, seconds=0.256)  # 1 ms a token
    assert pacing.admits(0, 512)  # a step's first prompt always goes in
    assert pacing.admits(60, 40)
    assert not pacing.admits(60, 41)
    # The estimate follows later steps.
    for _ in range(40):
        pacing.observe(num_tokens=1000, prompt_tokens=1000, seconds=0.01)
    assert pacing.seconds_per_token == pytest.approx(1e-5, rel=0.01)
    assert pacing.admits(5000, 4000)


def test_a_slow_device_gives_each_prompt_its_own_step() -> None:
    sched, _ = make(num_blocks=64, max_num_tokens=64)
    sched.pacing.observe(num_tokens=64, prompt_tokens=64, seconds=0.64)  # 10 ms a token
    for rid in "abc":
        sched.add(req(rid, 12))
    assert plan(run_step(sched)) == [("a", 12, True)]
    # Decodes still join, and the next prompt takes the step's prompt share.
    assert plan(run_step(sched)) == [("a", 1, True), ("b", 12, True)]
    assert plan(run_step(sched)) == [("a", 1, True), ("b", 1, True), ("c", 12, True)]


def test_a_backlog_packs_prompts_into_the_budget_again() -> None:
    sched, _ = make(num_blocks=256, max_num_tokens=48, max_batch_size=16)
    sched.pacing.observe(num_tokens=64, prompt_tokens=64, seconds=0.64)  # 10 ms a token
    names = [f"r{i}" for i in range(PACED_BACKLOG + 3)]
    for rid in names:
        sched.add(req(rid, 12))
    # The step packs prompts while more than PACED_BACKLOG wait (the budget
    # would take four), then paces: one prompt a step beside the decodes.
    assert plan(run_step(sched)) == [(rid, 12, True) for rid in names[:3]]
    assert len(sched.waiting) == PACED_BACKLOG
    assert [p for p in plan(run_step(sched)) if p[1] > 1] == [(names[3], 12, True)]


def test_a_fast_device_packs_prompts_into_the_budget() -> None:
    sched, _ = make(num_blocks=64, max_num_tokens=32)
    sched.pacing.observe(num_tokens=64, prompt_tokens=64, seconds=64e-6)  # 1 us a token
    for rid in "abc":
        sched.add(req(rid, 12))
    assert plan(run_step(sched)) == [("a", 12, True), ("b", 12, True), ("c", 8, False)]


def test_a_chunked_prompt_in_flight_counts_toward_the_step() -> None:
    sched, _ = make(num_blocks=64, max_num_tokens=16)
    sched.add(req("long", 24))
    sched.add(req("short", 4))
    assert plan(run_step(sched)) == [("long", 16, False)]
    sched.pacing.observe(num_tokens=64, prompt_tokens=64, seconds=0.64)  # 10 ms a token
    assert plan(run_step(sched)) == [("long", 8, True)]
    assert plan(run_step(sched)) == [("long", 1, True), ("short", 4, True)]
