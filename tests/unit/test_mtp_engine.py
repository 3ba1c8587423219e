"""MTP drafting through the engine: a Nemotron-H with M, *, - and E layers
and one MTP step (`*E`), and the VL wrapper with an image. Speculation on
must give exactly the tokens (and logprobs within 1e-4) of speculation off,
greedy and seeded, V1 and V2, with chunked prefill and preemption, with
hybrid prefix reuse, and nothing left allocated after an abort mid-verify.

A tiny checkpoint's random MTP layers never predict its random backbone, so
`bigram` rewires both (`tests.mtp_bigram`), the same way on every engine of
a comparison: drafts are accepted and rejected both, at positions the test
does not choose. Every case asserts both.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from engine.grammar import GrammarSpec
from engine.instance import EngineInstance
from engine.multimodal import ImageInput
from engine.request import FinishReason, Request
from engine.sampling import SamplingParams
from engine.speculation.config import SpeculativeConfig
from engine.speculation.mtp import KeptChunk, MTPDrafting
from kvcache.snapshots import SnapshotPolicy
from models.embedded.configs import IMAGE_TOKEN_ID
from models.embedded.writer import ensure_checkpoint
from models.image_processing import load_image_processor_config
from tests.mtp_bigram import rewire
from tests.spec_engines import (
    assert_abort_mid_verify_frees_everything,
    assert_same,
    copy_prompts,
    engine,
    serve,
)

MTP = SpeculativeConfig(method="mtp", num_speculative_tokens=3)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mtp")
    return ensure_checkpoint(root / "nemotron_h", "nemotron_h", "tiny", mtp=True)


@pytest.fixture(scope="module")
def vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mtp")
    return ensure_checkpoint(root / "nemotron_vl", "nemotron_vl", "tiny", mtp=True)


def bigram(instance: EngineInstance) -> EngineInstance:
    """Rewire the LM head (and, when built, the MTP's input fusion) as the
    module docstring says; the same on every engine of the same checkpoint."""
    model: Any = getattr(instance.model, "language_model", instance.model)
    rewire(dict(model.named_parameters()))
    return instance


def mtp_engine(checkpoint: Path, speculative: SpeculativeConfig | None, **kw: Any) -> Any:
    return bigram(engine(checkpoint, speculative, **kw))


def assert_mixed(instance: EngineInstance) -> None:
    """Drafts were verified, some accepted and some not."""
    drafter = instance.core.drafter
    assert drafter is not None
    stats = drafter.stats
    assert stats.verifies > 0
    assert 0 < stats.accepted < stats.drafted, stats


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_greedy_is_the_same_with_mtp_drafts(hybrid: Path, manager: str) -> None:
    prompts = copy_prompts(1)
    on = mtp_engine(hybrid, MTP, manager=manager)
    want = serve(mtp_engine(hybrid, None, manager=manager), prompts)
    assert_same(serve(on, prompts), want)
    assert_mixed(on)


def test_seeded_sampling_is_the_same_with_mtp_drafts(hybrid: Path) -> None:
    prompts = copy_prompts(2)
    params = {"temperature": 0.8, "top_k": 8, "seed": "each"}
    on = mtp_engine(hybrid, MTP)
    want = serve(mtp_engine(hybrid, None), prompts, **params)
    assert_same(serve(on, prompts, **params), want)
    assert_mixed(on)


def test_chunked_prefill_and_preemption_mid_speculation(hybrid: Path) -> None:
    small = {"max_tokens": 224, "step_tokens": 24}
    prompts = copy_prompts(3, count=6)
    want = serve(mtp_engine(hybrid, None, **small), prompts, max_tokens=40)
    on = mtp_engine(hybrid, MTP, **small)
    got = serve(on, prompts, max_tokens=40)
    assert serve.preempted > 0  # type: ignore[attr-defined]
    assert_same(got, want)
    assert_mixed(on)


def test_hybrid_prefix_reuse_with_mtp(hybrid: Path) -> None:
    """Snapshots every block: the second pass resumes from reused blocks
    (their MTP K/V included) and snapshots, with the tokens of a run
    without reuse or drafts."""
    policy = SnapshotPolicy(interval=16, num_slots=32)
    prompts = copy_prompts(4)
    off = mtp_engine(hybrid, None)
    first_want = serve(off, prompts, max_tokens=40)
    follow = [
        p + r.output_token_ids + [11, 12, 13] for p, r in zip(prompts, first_want, strict=True)
    ]
    again_want = serve(off, follow)
    on = mtp_engine(hybrid, MTP, policy=policy)
    assert_same(serve(on, prompts, max_tokens=40), first_want)
    again = serve(on, follow)
    assert_same(again, again_want)
    assert all(r.num_cached_tokens >= 32 for r in again)
    assert_mixed(on)


Drafts = dict[tuple[tuple[int, ...], int], tuple[int, ...]]
Outputs = dict[tuple[tuple[int, ...], int], torch.Tensor]


class _SpyModel:
    """The runner's model as MTP drafting sees it, keeping the hidden states
    whose logits give the drafts (`compute_logits`'s inputs, in call order)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls: list[torch.Tensor] = []

    def mtp_forward(self, *args: Any) -> torch.Tensor:
        return self.model.mtp_forward(*args)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls.append(hidden.clone())
        return self.model.compute_logits(hidden)


def recorded_drafts(instance: EngineInstance) -> tuple[Drafts, Outputs]:
    """Wrap the runner's MTP: every step's drafts, and the MTP output whose
    logits gave the first draft, by (prompt, last kept position)."""
    mtp = instance.runner.mtp
    assert isinstance(mtp, MTPDrafting)
    spy = _SpyModel(mtp.model)
    mtp.model = spy
    drafts: Drafts = {}
    outputs: Outputs = {}
    draft = mtp.draft

    def record(chunks: list[KeptChunk], hidden: torch.Tensor, caches: Any) -> dict:
        spy.calls.clear()
        out = draft(chunks, hidden, caches)
        drafting = [c for c in chunks if c.next_tokens and c.drafts]
        for n, chunk in enumerate(drafting):
            prompt = instance.core.requests[chunk.request_id].prompt_token_ids
            key = (tuple(prompt), chunk.last)
            drafts[key] = tuple(out[chunk.index])
            outputs[key] = spy.calls[0][n]
        return out

    mtp.draft = record  # type: ignore[method-assign]
    return drafts, outputs


def test_drafts_after_a_verify_equal_those_of_plain_decoding(hybrid: Path) -> None:
    """The MTP catch-up over a verify's accepted positions leaves its cache
    as one position a step would: at every position both runs drafted
    from, the MTP output (within 1e-4 of its scale) and the drafts are the
    same. A plain engine with MTP drafts but no verifies (its drafter
    removed) drafts at every position."""
    prompts = copy_prompts(5)
    plain = mtp_engine(hybrid, MTP)
    plain.core.drafter = plain.core.scheduler.drafter = None
    every, every_out = recorded_drafts(plain)
    want = serve(plain, prompts)
    on = mtp_engine(hybrid, MTP)
    verified, verified_out = recorded_drafts(on)
    assert_same(serve(on, prompts), want)
    assert_mixed(on)
    assert verified and set(verified) < set(every)
    assert {key: every[key] for key in verified} == verified
    for key, out in verified_out.items():
        scale = every_out[key].abs().max()
        torch.testing.assert_close(out, every_out[key], rtol=0, atol=1e-4 * float(scale))


def test_the_context_role_hands_off_its_first_drafts(hybrid: Path) -> None:
    """A context worker drafts after the first token and its handoff carries
    the drafts, which are what an aggregated worker verifies next."""
    prompt = copy_prompts(6, count=1)[0]
    context = mtp_engine(hybrid, MTP, role="context")
    assert context.core.drafter is None  # it verifies nothing
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    request = Request("c", list(prompt), params)
    context.core.add(request)
    events = []
    while context.core.has_work():
        events += context.core.step().events
    (handoff,) = [e for e in events if e.finish_reason == FinishReason.HANDOFF.value]
    assert len(handoff.draft_token_ids) == MTP.num_speculative_tokens
    aggregated = mtp_engine(hybrid, MTP)
    seen, _ = recorded_drafts(aggregated)
    serve(aggregated, [prompt], max_tokens=8)
    assert seen[(tuple(prompt), len(prompt) - 1)] == tuple(handoff.draft_token_ids)
    context.core.free_cache("c")  # the pull that never comes
    assert context.manager.num_free_blocks == context.manager.num_usable_blocks


def test_an_abort_mid_verify_frees_everything(hybrid: Path) -> None:
    assert_abort_mid_verify_frees_everything(mtp_engine(hybrid, MTP), copy_prompts(7))


def image_request(checkpoint: Path, instance: EngineInstance, name: str) -> Request:
    vision = instance.model_config.vision
    assert vision is not None
    processing = load_image_processor_config(checkpoint, vision)
    noise = torch.randint(0, 256, (40, 56, 3), generator=torch.Generator().manual_seed(3))
    buffer = io.BytesIO()
    Image.fromarray(noise.byte().numpy()).save(buffer, format="PNG")
    data = buffer.getvalue()
    grid = processing.patch_grid(40, 56)
    num_tokens = processing.num_image_tokens(grid)
    image = ImageInput(hashlib.sha256(data).digest(), data, grid, 3, num_tokens)
    passage = copy_prompts(8, count=1)[0]
    prompt = [40, 41, 42] + [IMAGE_TOKEN_ID] * num_tokens + passage
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    return Request(name, prompt, params, images=(image,))


def run_one(instance: EngineInstance, request: Request) -> Request:
    instance.core.add(request)
    while instance.core.has_work():
        instance.core.step()
    assert instance.manager.num_requests == 0
    return request


def test_vl_wrapper_with_an_image_is_the_same_with_mtp_drafts(vl: Path) -> None:
    off = mtp_engine(vl, None)
    want = run_one(off, image_request(vl, off, "off"))
    on = mtp_engine(vl, MTP)
    got = run_one(on, image_request(vl, on, "on"))
    assert_same([got], [want])
    assert_mixed(on)


def test_mtp_drafts_under_a_grammar_equal_plain_constrained_decoding(hybrid: Path) -> None:
    """Structured output (`engine.grammar`) with MTP drafts: every verify
    position is masked after its drafts, so drafts the grammar refuses
    (tokens holding a q or a z) are rejected where they stand and the
    output is plain constrained decoding's."""
    grammar = GrammarSpec("regex", "[^qz]{1,80}")
    params = {"grammar": grammar, "ignore_eos": False, "max_tokens": 24}
    prompts = copy_prompts(6)
    on = mtp_engine(hybrid, MTP)
    want = serve(mtp_engine(hybrid, None), prompts, **params)
    got = serve(on, prompts, **params)
    assert_same(got, want)
    assert_mixed(on)
    for request in got:
        text = on.tokenizer.decode(request.output_token_ids)
        assert "q" not in text and "z" not in text
