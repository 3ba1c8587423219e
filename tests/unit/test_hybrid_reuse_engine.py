"""Hybrid prefix reuse through the whole engine: a Nemotron-H checkpoint with
M, *, - and E layers, reuse on against reuse off, same greedy tokens and
logprobs within 1e-4, and hits that really skipped tokens.

Each case runs the same requests on two engines built from one checkpoint
(fp32, CPU, in this process) and compares every token and logprob.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.instance import EngineInstance
from engine.request import Request
from engine.sampling import SamplingParams
from engine.worker_config import WorkerConfig
from kvcache.snapshots import SnapshotPolicy

TOLERANCE = 1e-4
PREEMPTED: dict[int, int] = {}  # engine -> preemptions so far


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.embedded.writer import ensure_checkpoint

    path = ensure_checkpoint(tmp_path_factory.mktemp("hybrid") / "nemotron_h", "nemotron_h", "tiny")
    pattern = (path / "config.json").read_text()
    assert all(kind in pattern for kind in ('"M', "*", "-", "E"))
    return path


def engine(
    checkpoint: Path, policy: SnapshotPolicy | None, max_tokens: int = 4096, step_tokens: int = 512
) -> EngineInstance:
    config = WorkerConfig(
        checkpoint=str(checkpoint),
        manager="v2",
        dtype="float32",
        max_tokens=max_tokens,
        max_num_tokens=step_tokens,
        max_batch_size=8,
        enable_block_reuse=policy is not None,
        snapshots=policy,
    )
    return EngineInstance.build(config, "aggregated", "w")


def serve(
    instance: EngineInstance, prompts: list[list[int]], max_tokens: int = 12
) -> list[Request]:
    """Run `prompts` together to their ends (counting preemptions in `PREEMPTED`)."""
    requests = []
    for prompt in prompts:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
        request = Request(f"r{len(instance.core.requests)}-{random.random()}", list(prompt), params)
        instance.core.add(request)
        requests.append(request)
    while instance.core.has_work():
        PREEMPTED[id(instance)] = (
            PREEMPTED.get(id(instance), 0) + instance.core.step().num_preempted
        )
    instance.manager.check_integrity()
    return requests


def assert_same(on: list[Request], off: list[Request]) -> None:
    for a, b in zip(on, off, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert (
            max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs, strict=True))
            < TOLERANCE
        )


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 500) for _ in range(n)]


def test_a_four_turn_conversation_resumes_each_turn_after_the_last(checkpoint: Path) -> None:
    rng = random.Random(0)
    on, off = engine(checkpoint, SnapshotPolicy(num_slots=8)), engine(checkpoint, None)
    conversations = [tokens(rng, 45 + c) for c in range(3)]
    for turn in range(4):
        got, want = serve(on, conversations), serve(off, conversations)
        assert_same(got, want)
        for request, prompt in zip(got, conversations, strict=True):
            # Turn N+1 starts with turn N's prompt and output: all but the
            # last output token (never fed back) are skipped.
            expected = 0 if turn == 0 else len(prompt) - 6
            assert request.num_cached_tokens == expected
        conversations = [
            p + r.output_token_ids + tokens(rng, 5) for p, r in zip(conversations, got, strict=True)
        ]


def test_a_shared_system_prompt_hits_from_the_third_request(checkpoint: Path) -> None:
    rng = random.Random(1)
    on, off = engine(checkpoint, SnapshotPolicy(num_slots=8)), engine(checkpoint, None)
    system = tokens(rng, 50)
    cached = []
    for _ in range(4):
        prompt = [system + tokens(rng, 9)]
        got = serve(on, prompt)
        assert_same(got, serve(off, prompt))
        cached.append(got[0].num_cached_tokens)
    assert cached == [0, 0, 48, 48]


def test_chunked_prefill_ends_chunks_at_periodic_snapshots(checkpoint: Path) -> None:
    rng = random.Random(2)
    policy = SnapshotPolicy(interval=16, at_end=False, on_demand=False, num_slots=16)
    on, off = engine(checkpoint, policy, step_tokens=20), engine(checkpoint, None, step_tokens=20)
    system = tokens(rng, 50)
    cached = []
    for _ in range(3):
        prompt = [system + tokens(rng, 9)]
        got = serve(on, prompt)
        assert_same(got, serve(off, prompt))
        cached.append(got[0].num_cached_tokens)
    assert cached == [0, 48, 48]


def test_preemption_and_a_tiny_snapshot_budget_keep_tokens_exact(checkpoint: Path) -> None:
    rng = random.Random(3)
    policy = SnapshotPolicy(interval=16, num_slots=2)
    on = engine(checkpoint, policy, max_tokens=256, step_tokens=24)
    off = engine(checkpoint, None, max_tokens=256, step_tokens=24)
    system = tokens(rng, 50)
    for _ in range(4):
        prompts = [system + tokens(rng, 9) for _ in range(4)]
        got = serve(on, prompts, max_tokens=20)
        assert_same(got, serve(off, prompts, max_tokens=20))
    store = on.manager.hybrid_reuse.store
    assert PREEMPTED[id(on)] > 0
    assert store.hits > 0 and store.evictions > 0 and store.dropped > 0
    assert on.manager.evictions > 0
