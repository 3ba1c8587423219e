"""Engines and request loops for the speculative decoding tests: one
in-process `EngineInstance` per case, requests stepped to the end, outputs
compared with and without speculation."""

from __future__ import annotations

import random
from pathlib import Path

from engine.instance import EngineInstance
from engine.request import Request
from engine.sampling import SamplingParams
from engine.speculation.config import SpeculativeConfig
from engine.worker_config import WorkerConfig
from kvcache.snapshots import SnapshotPolicy

TOLERANCE = 1e-4


def engine(
    checkpoint: Path,
    speculative: SpeculativeConfig | None,
    manager: str = "v2",
    max_tokens: int = 4096,
    step_tokens: int = 512,
    policy: SnapshotPolicy | None = None,
    role: str = "aggregated",
) -> EngineInstance:
    config = WorkerConfig(
        checkpoint=str(checkpoint),
        manager=manager,
        dtype="float32",
        block_size=16,
        max_tokens=max_tokens,
        max_num_tokens=step_tokens,
        max_batch_size=8,
        speculative=speculative,
        enable_block_reuse=policy is not None,
        snapshots=policy,
    )
    return EngineInstance.build(config, role, "w")


def serve(instance: EngineInstance, prompts: list[list[int]], **params: object) -> list[Request]:
    requests = []
    for n, prompt in enumerate(prompts):
        settings: dict[str, object] = {
            "max_tokens": 24,
            "temperature": 0.0,
            "ignore_eos": True,
            "logprobs": 0,
        }
        settings.update(params)
        if settings.get("seed") == "each":
            settings["seed"] = 100 + n
        request = Request(f"r{n}-{random.random()}", list(prompt), SamplingParams(**settings))  # type: ignore[arg-type]
        instance.core.add(request)
        requests.append(request)
    preempted = 0
    while instance.core.has_work():
        preempted += instance.core.step().num_preempted
    instance.manager.check_integrity()
    assert instance.manager.num_requests == 0
    serve.preempted = preempted  # type: ignore[attr-defined]
    return requests


def assert_same(on: list[Request], off: list[Request]) -> None:
    for a, b in zip(on, off, strict=True):
        assert a.output_token_ids == b.output_token_ids
        diffs = [abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs, strict=True)]
        assert len(a.output_logprobs) == len(a.output_token_ids)
        assert max(diffs) < TOLERANCE


def copy_prompts(seed: int, count: int = 4) -> list[list[int]]:
    """A passage, then its opening again: the continuation quotes it."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        passage = [rng.randrange(10, 400) for _ in range(rng.randrange(20, 40))]
        prompts.append(passage + passage[: rng.randrange(3, 8)])
    return prompts


def assert_drafted(instance: EngineInstance) -> None:
    drafter = instance.core.drafter
    assert drafter is not None
    stats = drafter.stats
    assert stats.verifies > 0
    assert 0 < stats.accepted < stats.drafted


def assert_abort_mid_verify_frees_everything(
    instance: EngineInstance, prompts: list[list[int]]
) -> None:
    """Start `prompts`, step until three verifies ran, abort them all: no
    block, slot or request is left behind."""
    requests = []
    for n, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        requests.append(Request(f"a{n}", prompt, params))
        instance.core.add(requests[-1])
    drafter = instance.core.drafter
    assert drafter is not None
    while drafter.stats.verifies < 3:
        instance.core.step()
    for r in requests:
        instance.core.abort(r.request_id)
    instance.manager.check_integrity()
    assert instance.manager.num_requests == 0
    assert instance.manager.num_free_blocks == instance.manager.num_usable_blocks
