"""n samples from one prefill (`engine.samples`) in an in-process engine:
forked caches, per-sample random streams, one stream end per request."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from engine.instance import EngineInstance
from engine.messages import StepTokens
from engine.request import Request
from engine.samples import sample_seed
from engine.sampling import SamplingParams
from engine.speculation.config import SpeculativeConfig
from kvcache.snapshots import SnapshotPolicy
from models.embedded.writer import ensure_checkpoint
from tests.spec_engines import copy_prompts, engine

NGRAM = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
PROMPT = copy_prompts(5, 1)[0]  # 23 .. 47 tokens: a partly filled last block of 16


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_checkpoint(tmp_path_factory.mktemp("samples") / "llama", "llama", "tiny")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_checkpoint(
        tmp_path_factory.mktemp("samples") / "nemotron_h", "nemotron_h", "tiny"
    )


def params(**overrides: object) -> SamplingParams:
    settings: dict[str, object] = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    settings.update(overrides)
    return SamplingParams(**settings)  # type: ignore[arg-type]


def run(
    instance: EngineInstance, prompt: list[int], request_id: str = "r", **kw: object
) -> dict[int, list[int]]:
    """Every sample's tokens of one request, by sample index, and its final events."""
    instance.core.add(Request(request_id, list(prompt), params(**kw)))
    tokens: dict[int, list[int]] = defaultdict(list)
    finals = []
    while instance.core.has_work():
        result = instance.core.step()
        for item in result.outgoing():
            events = (
                [item.event(i) for i in range(len(item))]
                if isinstance(item, StepTokens)
                else [item]
            )
            for event in events:
                assert event.request_id == request_id
                tokens[event.sample] += event.token_ids
                if event.finish_reason is not None:
                    finals.append(event)
    instance.manager.check_integrity()
    assert instance.manager.num_requests == 0
    assert instance.manager.num_free_blocks == instance.manager.num_usable_blocks
    assert len(finals) == 1, "the stream ends once, after every sample"
    return dict(tokens)


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_greedy_samples_equal_the_greedy_answer(llama: Path, manager: str) -> None:
    instance = engine(llama, None, manager=manager)
    (one,) = run(instance, PROMPT).values()
    samples = run(instance, PROMPT, "r3", n=3)
    assert sorted(samples) == [0, 1, 2]
    assert all(tokens == one for tokens in samples.values())
    assert len(one) == 12


def test_seeded_samples_are_reproducible_and_sample_0_is_the_seed_itself(llama: Path) -> None:
    instance = engine(llama, None)
    sampled: dict[str, object] = {"temperature": 1.0, "seed": 7}
    first = run(instance, PROMPT, "first", n=4, **sampled)
    again = run(instance, PROMPT, "again", n=4, **sampled)
    assert first == again
    assert len({tuple(tokens) for tokens in first.values()}) > 1
    (alone,) = run(instance, PROMPT, "alone", **sampled).values()
    assert first[0] == alone
    (second,) = run(instance, PROMPT, "s2", **{**sampled, "seed": sample_seed(7, 2)}).values()
    assert first[2] == second


def test_the_prompt_is_prefilled_once_and_its_full_blocks_held_once(llama: Path) -> None:
    instance = engine(llama, None)
    manager = instance.manager
    free = manager.num_free_blocks
    instance.core.add(Request("r", list(PROMPT), params(n=4)))
    result = instance.core.step()
    assert result.num_tokens == len(PROMPT)  # one prefill
    prompt_blocks = -(-len(PROMPT) // 16)
    # The prompt's blocks once, plus a copy of its partly filled last block per extra sample.
    assert free - manager.num_free_blocks == prompt_blocks + 3
    result = instance.core.step()
    assert result.num_seqs == 4 and result.num_tokens == 4  # four decodes
    manager.check_integrity()
    assert instance.core.abort("r") is not None
    assert manager.num_requests == 0 and manager.num_free_blocks == free
    manager.check_integrity()
    assert not instance.core.has_work()


def test_abort_right_after_the_fork_frees_every_sample(hybrid: Path) -> None:
    instance = engine(hybrid, None)
    pool = instance.manager.mamba_pool
    assert pool is not None
    instance.core.add(Request("r", list(PROMPT), params(n=3)))
    instance.core.step()
    assert instance.manager.num_requests == 3
    instance.core.abort("r")
    instance.manager.check_integrity()
    assert instance.manager.num_requests == 0
    instance.core.step()  # the pending copies' sources are released
    assert pool.num_free_slots == pool.num_slots
    assert instance.manager.num_free_blocks == instance.manager.num_usable_blocks


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_hybrid_samples_copy_the_mamba_state(hybrid: Path, manager: str) -> None:
    instance = engine(hybrid, None, manager=manager)
    (one,) = run(instance, PROMPT).values()
    samples = run(instance, PROMPT, "r2", n=2)
    assert samples == {0: one, 1: one}


def test_hybrid_samples_with_block_reuse(hybrid: Path) -> None:
    instance = engine(hybrid, None, policy=SnapshotPolicy(num_slots=8, interval=16))
    (one,) = run(instance, PROMPT).values()
    assert run(instance, PROMPT, "r2", n=2) == {0: one, 1: one}
    assert run(instance, PROMPT, "r3", n=3) == {0: one, 1: one, 2: one}


@pytest.mark.parametrize("checkpoint", ["llama", "hybrid"])
def test_samples_with_ngram_speculation(request: pytest.FixtureRequest, checkpoint: str) -> None:
    path = request.getfixturevalue(checkpoint)
    (one,) = run(engine(path, None), PROMPT, max_tokens=24).values()
    spec = engine(path, NGRAM)
    assert run(spec, PROMPT, n=2, max_tokens=24) == {0: one, 1: one}
    sampled: dict[str, object] = {"temperature": 0.8, "seed": 3, "n": 3, "max_tokens": 24}
    assert run(spec, PROMPT, "s", **sampled) == run(engine(path, None), PROMPT, "s", **sampled)


def test_samples_that_stop_at_their_first_token_end_alone(llama: Path) -> None:
    instance = engine(llama, None)
    samples = run(instance, PROMPT, n=3, max_tokens=1)
    assert sorted(samples) == [0, 1, 2] and all(len(t) == 1 for t in samples.values())
