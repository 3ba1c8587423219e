"""Structured output in the engine (`engine.grammar`): outputs of a tiny
random Llama under a JSON schema, a choice list, a regex and an EBNF grammar
are sentences of the grammar, greedy and sampled; rows of other requests in
the same steps are untouched; n samples each follow the grammar; and with
speculative decoding every verify position is masked, so the output equals
speculation off, with drafts the grammar refuses among the rejected ones."""

from __future__ import annotations

import json
import logging
import random
import re
from pathlib import Path

import pytest
import torch

from engine.grammar import GrammarError, GrammarSpec, check_grammar
from engine.instance import EngineInstance
from engine.request import FinishReason, Request
from engine.sampling import SamplingParams
from engine.speculation.config import SpeculativeConfig
from engine.speculation.drafts import Drafter
from models.embedded.writer import ensure_checkpoint
from tests.spec_engines import assert_drafted, assert_same, engine, serve

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "integer"}},
    "required": ["color", "size"],
}
SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
CONSTRAINED = {"ignore_eos": False, "max_tokens": 48}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_checkpoint(tmp_path_factory.mktemp("grammar") / "llama", "llama", "tiny")


@pytest.fixture(scope="module")
def instance(llama: Path) -> EngineInstance:
    return engine(llama, None)


def prompts(instance: EngineInstance, count: int = 3) -> list[list[int]]:
    texts = ["The weather today", "Name a color and a size:", "a b c d e f", "Once upon"]
    return [instance.tokenizer.encode(t) for t in texts[:count]]


def text(instance: EngineInstance, request: Request) -> str:
    return instance.tokenizer.decode(request.output_token_ids)


def assert_valid(value: object) -> None:
    assert isinstance(value, dict) and set(value) == {"color", "size"}
    assert value["color"] in {"red", "green", "blue"}
    assert isinstance(value["size"], int) and not isinstance(value["size"], bool)


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": "each"}])
def test_json_schema_outputs_parse_and_validate(instance: EngineInstance, sampling: dict) -> None:
    grammar = GrammarSpec.json_schema(SCHEMA)
    for request in serve(instance, prompts(instance), grammar=grammar, **CONSTRAINED, **sampling):
        assert request.finish_reason is FinishReason.STOP
        assert request.output_token_ids[-1] in instance.tokenizer.eos_token_ids
        assert_valid(json.loads(text(instance, request)))


def test_choice_regex_and_ebnf_outputs_are_sentences_of_their_grammars(
    instance: EngineInstance,
) -> None:
    cases = [
        (GrammarSpec.choices(["yes", "no way", "maybe"]), lambda t: t in {"yes", "no way", "maybe"}),
        (GrammarSpec("regex", "[a-c]{3}-[0-9]{1,4}"), lambda t: re.fullmatch("[a-c]{3}-[0-9]{1,4}", t)),
        (GrammarSpec("ebnf", 'root ::= "(" [0-9] [0-9]? ")" | "none"'),
         lambda t: re.fullmatch(r"\([0-9]{1,2}\)|none", t)),
    ]  # fmt: skip
    for grammar, ok in cases:
        for params in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 5}):
            for request in serve(
                instance, prompts(instance), grammar=grammar, **CONSTRAINED, **params
            ):
                assert request.finish_reason is FinishReason.STOP
                assert ok(text(instance, request)), (grammar, text(instance, request))


def test_json_object_is_an_object_or_cut_by_max_tokens(instance: EngineInstance) -> None:
    for request in serve(
        instance,
        prompts(instance),
        grammar=GrammarSpec("json_object"),
        ignore_eos=False,
        max_tokens=64,
    ):
        output = text(instance, request)
        assert output.startswith("{")
        if request.finish_reason is FinishReason.STOP:
            assert isinstance(json.loads(output), dict)
        assert " \n" not in output and "\t" not in output  # compact: no free whitespace


def test_other_rows_of_the_same_steps_are_untouched(instance: EngineInstance) -> None:
    batch = prompts(instance, 4)
    alone = serve(instance, batch[:2], max_tokens=20)
    requests = [
        Request(f"free-{i}-{random.random()}", p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0))
        for i, p in enumerate(batch[:2])
    ] + [
        Request(f"json-{i}-{random.random()}", p, SamplingParams(max_tokens=48, temperature=0.0, grammar=GrammarSpec.json_schema(SCHEMA)))
        for i, p in enumerate(batch[2:])
    ]  # fmt: skip
    for request in requests:
        instance.core.add(request)
    while instance.core.has_work():
        instance.core.step()
    assert_same(requests[:2], alone)
    for request in requests[2:]:
        assert_valid(json.loads(text(instance, request)))


def test_n_samples_each_follow_the_grammar(instance: EngineInstance) -> None:
    grammar = GrammarSpec.json_schema(SCHEMA)
    (one,) = serve(instance, prompts(instance, 1), grammar=grammar, **CONSTRAINED)
    request = Request(
        f"n-{random.random()}",
        prompts(instance, 1)[0],
        SamplingParams(n=3, temperature=0.0, grammar=grammar, **CONSTRAINED),
    )  # type: ignore[arg-type]
    sampled = Request(
        f"s-{random.random()}",
        prompts(instance, 1)[0],
        SamplingParams(n=3, temperature=1.0, seed=9, grammar=grammar, **CONSTRAINED),
    )  # type: ignore[arg-type]
    for r in (request, sampled):
        instance.core.add(r)
    samples: dict[str, list[Request]] = {request.request_id: [], sampled.request_id: []}
    while instance.core.has_work():
        for done in instance.core.step().finished:
            samples[done.stream_id].append(done)
    assert len(samples[request.request_id]) == 3
    for greedy in samples[request.request_id]:
        assert greedy.output_token_ids == one.output_token_ids
    for s in samples[sampled.request_id]:
        assert_valid(json.loads(text(instance, s)))
    instance.manager.check_integrity()
    assert instance.manager.num_requests == 0


class _Drafts(Drafter):
    """Drafts the tokens plain decoding gave each prompt, every third one
    replaced by a token the grammar refuses there (a letter where JSON
    syntax or a digit must come) or by another allowed one."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], wrong: list[int]) -> None:
        super().__init__(SPEC)
        self.answers = answers
        self.wrong = wrong
        self.rng = random.Random(3)
        self.num_wrong = 0

    def propose(self, request: Request, limit: int) -> list[int]:
        answer = self.answers[tuple(request.prompt_token_ids)]
        done = request.num_output_tokens
        drafts = answer[done : done + min(limit, SPEC.num_speculative_tokens)]
        out = [t if self.rng.random() > 0.34 else self.rng.choice(self.wrong) for t in drafts]
        self.num_wrong += sum(a != b for a, b in zip(out, drafts, strict=True))
        return out


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": "each"}])
def test_speculation_on_equals_off_with_every_draft_position_masked(
    llama: Path, instance: EngineInstance, sampling: dict
) -> None:
    grammar = GrammarSpec.json_schema(SCHEMA)
    batch = prompts(instance)
    want = serve(instance, batch, grammar=grammar, **CONSTRAINED, **sampling)
    on = engine(llama, SPEC)
    wrong = on.tokenizer.encode("qz", add_special_tokens=False) + on.tokenizer.encode(
        '1"', add_special_tokens=False
    )
    drafter = _Drafts({tuple(r.prompt_token_ids): r.output_token_ids for r in want}, wrong)
    on.core.drafter = on.core.scheduler.drafter = drafter
    got = serve(on, batch, grammar=grammar, **CONSTRAINED, **sampling)
    assert_same(got, want)
    assert_drafted(on)
    assert drafter.num_wrong > 0


def test_a_grammar_that_does_not_compile_is_refused_before_it_runs(
    instance: EngineInstance,
) -> None:
    broken = Request("broken", [1, 2, 3], SamplingParams(grammar=GrammarSpec("regex", "(a")))
    with pytest.raises(GrammarError, match="parenthesis is not closed"):
        instance.core.add(broken)
    assert "broken" not in instance.core.requests and not instance.core.has_work()


def test_an_output_outside_its_grammar_may_only_end(
    instance: EngineInstance, caplog: pytest.LogCaptureFixture
) -> None:
    grammars = instance.runner.grammars
    assert grammars is not None
    request = Request("outside", [1, 2, 3], SamplingParams(grammar=GrammarSpec.choices(["yes"])))
    request.output_token_ids = instance.tokenizer.encode("no", add_special_tokens=False)
    logits = torch.zeros(1, grammars.vocab_size)
    with caplog.at_level(logging.ERROR, logger="engine.grammar"):
        masked = grammars.mask(logits, [request], [()])
    allowed = set(torch.nonzero(masked[0] > -float("inf")).flatten().tolist())
    assert allowed == set(instance.tokenizer.eos_token_ids)
    assert "left its grammar" in caplog.text
    grammars.release("outside")


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (GrammarSpec("json_schema", '{"type": "objectx"}'), 'Unsupported type "objectx"'),
        (GrammarSpec("regex", "[a-"), "Regex parsing error"),
        (GrammarSpec("ebnf", "root ::= other"), 'Rule "other" is not defined'),
    ],
)
def test_check_grammar_names_the_problem_without_source_locations(
    spec: GrammarSpec, words: str
) -> None:
    with pytest.raises(GrammarError) as caught:
        check_grammar(spec)
    assert words in str(caught.value) and ".cc:" not in str(caught.value)


def test_specs_refuse_unknown_kinds_and_empty_choices() -> None:
    with pytest.raises(ValueError, match="grammar kind"):
        GrammarSpec("yaml")
    with pytest.raises(ValueError, match="non-empty"):
        GrammarSpec.choices([])
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(grammar=GrammarSpec("json_object"), ignore_eos=True)


def test_a_schema_compiles_once_per_worker(llama: Path) -> None:
    fresh = engine(llama, None)
    grammars = fresh.runner.grammars
    assert grammars is not None
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]}
    serve(fresh, prompts(fresh), grammar=GrammarSpec.json_schema(schema), **CONSTRAINED)
    serve(fresh, prompts(fresh, 2), grammar=GrammarSpec.json_schema(dict(schema)), **CONSTRAINED)
    assert grammars.num_compiled == 1
    serve(fresh, prompts(fresh, 1), grammar=GrammarSpec.choices(["a"]), **CONSTRAINED)
    assert grammars.num_compiled == 2
