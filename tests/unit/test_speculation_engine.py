"""Speculative decoding through the whole engine: n-gram drafts verified in
continuous batching, on a dense Llama and on a Nemotron-H hybrid (M, *, -
and E layers), V1 and V2. Speculation on must give exactly the tokens of
speculation off: greedy, and sampled with a seed (each verify position
samples with the draw plain decoding would use there), with logprobs within
1e-4, and without a block or slot left behind.

On the Llama, prompts repeat a passage and the n-gram drafter finds its
continuations there. The tiny hybrid's random weights never quote their
prompt, so its cases draft with `OracleDrafter`: the tokens plain decoding
produced, every few wrong, which puts accepted and rejected drafts at known
places. Each case asserts that drafts were accepted and rejected both.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.instance import EngineInstance
from engine.request import Request
from engine.speculation.config import SpeculativeConfig
from engine.speculation.drafts import Drafter
from kvcache.snapshots import SnapshotPolicy
from models.embedded.writer import ensure_checkpoint
from tests.spec_engines import (
    assert_abort_mid_verify_frees_everything,
    assert_drafted,
    assert_same,
    copy_prompts,
    engine,
    serve,
)

SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_checkpoint(tmp_path_factory.mktemp("spec") / "llama", "llama", "tiny")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_checkpoint(tmp_path_factory.mktemp("spec") / "nemotron_h", "nemotron_h", "tiny")


class OracleDrafter(Drafter):
    """Drafts the tokens plain decoding gave each prompt (`answers`), with
    about one in four replaced by a wrong token."""

    def __init__(self, config: SpeculativeConfig, answers: dict[tuple[int, ...], list[int]]):
        super().__init__(config)
        self.answers = answers
        self.rng = random.Random(7)

    def propose(self, request: Request, limit: int) -> list[int]:
        if request.params.has_penalties:
            return []
        answer = self.answers[tuple(request.prompt_token_ids)]
        done = request.num_output_tokens
        width = min(limit, self.config.num_speculative_tokens)
        drafts = answer[done : done + width]
        return [t if self.rng.random() > 0.25 else (t + 1) % 500 for t in drafts]


def with_oracle(instance: EngineInstance, answers: list[Request]) -> EngineInstance:
    oracle = OracleDrafter(SPEC, {tuple(r.prompt_token_ids): r.output_token_ids for r in answers})
    instance.core.drafter = instance.core.scheduler.drafter = oracle
    return instance


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_llama_greedy_is_the_same_with_drafts(llama: Path, manager: str) -> None:
    on, off = engine(llama, SPEC, manager), engine(llama, None, manager)
    prompts = copy_prompts(0)
    assert_same(serve(on, prompts), serve(off, prompts))
    assert_drafted(on)


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_hybrid_greedy_is_the_same_with_drafts(hybrid: Path, manager: str) -> None:
    off = engine(hybrid, None, manager)
    prompts = copy_prompts(1)
    want = serve(off, prompts)
    on = with_oracle(engine(hybrid, SPEC, manager), want)
    assert_same(serve(on, prompts), want)
    assert_drafted(on)


def test_hybrid_ngram_drafts_are_lossless_too(hybrid: Path) -> None:
    on, off = engine(hybrid, SPEC), engine(hybrid, None)
    prompts = copy_prompts(1)
    assert_same(serve(on, prompts), serve(off, prompts))


@pytest.mark.parametrize("name", ["llama", "hybrid"])
def test_seeded_sampling_is_the_same_with_drafts(name: str, request: pytest.FixtureRequest) -> None:
    checkpoint = request.getfixturevalue(name)
    off = engine(checkpoint, None)
    prompts = copy_prompts(2)
    params = {"temperature": 0.7, "top_k": 5, "seed": "each"}
    want = serve(off, prompts, **params)
    on = with_oracle(engine(checkpoint, SPEC), want)
    assert_same(serve(on, prompts, **params), want)
    assert_drafted(on)


def test_hybrid_chunked_prefill_and_preemption_mid_speculation(hybrid: Path) -> None:
    """A small cache and step budget: prompts chunk, verifies run beside
    prefill chunks, and requests are preempted between verifies."""
    off = engine(hybrid, None, max_tokens=224, step_tokens=24)
    prompts = copy_prompts(3, count=6)
    want = serve(off, prompts, max_tokens=40)
    on = with_oracle(engine(hybrid, SPEC, max_tokens=224, step_tokens=24), want)
    got = serve(on, prompts, max_tokens=40)
    assert serve.preempted > 0  # type: ignore[attr-defined]
    assert_same(got, want)
    assert_drafted(on)


def test_hybrid_reuse_keeps_only_accepted_states(hybrid: Path) -> None:
    """With snapshots every block, a verify never ends at or crosses a
    snapshot point, so a second pass resumes from states equal to plain
    decoding's: the same tokens as without reuse or drafts."""
    policy = SnapshotPolicy(interval=16, num_slots=32)
    off = engine(hybrid, None)
    prompts = copy_prompts(4)
    first_want = serve(off, prompts, max_tokens=40)
    follow = [
        p + r.output_token_ids + [11, 12, 13] for p, r in zip(prompts, first_want, strict=True)
    ]
    again_want = serve(off, follow)
    on = with_oracle(engine(hybrid, SPEC, policy=policy), [*first_want, *again_want])
    assert_same(serve(on, prompts, max_tokens=40), first_want)
    again = serve(on, follow)
    assert_same(again, again_want)
    assert all(r.num_cached_tokens >= 32 for r in again)
    assert_drafted(on)


def test_a_request_with_penalties_decodes_one_token_a_step(llama: Path) -> None:
    on, off = engine(llama, SPEC), engine(llama, None)
    prompts = copy_prompts(5, count=2)
    params = {"repetition_penalty": 1.3}
    assert_same(serve(on, prompts, **params), serve(off, prompts, **params))
    drafter = on.core.drafter
    assert drafter is not None and drafter.stats.verifies == 0


def test_an_abort_mid_speculation_frees_everything(hybrid: Path) -> None:
    prompts = copy_prompts(6)
    on = with_oracle(engine(hybrid, SPEC), serve(engine(hybrid, None), prompts, max_tokens=40))
    assert_abort_mid_verify_frees_everything(on, prompts)
