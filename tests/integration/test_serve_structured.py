"""Structured output served (`disagg serve`: aggregated, 1P1D, and 1P1D with
block reuse and n-gram speculation), through the `openai` client: a JSON
schema with an enum and an integer, a choice list, a regex and required
tool calls. Every greedy answer must be a sentence of its grammar and equal
the in-process aggregated engine's answer under the same grammar, so the
context worker's first token, the generation worker's continued matcher
and every verified draft are held to plain constrained decoding."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from engine.grammar import GrammarSpec
from tests.serve_process import MODES as SERVE_MODES
from tests.serve_process import ServeProcess, start_mode, stop_group
from tests.spec_engines import engine, serve

MODES = SERVE_MODES
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["color", "size"],
}
CHOICES = ["yes", "no", "maybe later"]
REGEX = "[a-c]{2}-[0-9]{1,3}"
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.embedded.writer import ensure_checkpoint

    return ensure_checkpoint(tmp_path_factory.getbasetemp() / "structured-llama", "llama", "tiny")


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> dict[tuple[str, int], list[int]]:
    """The aggregated in-process engine's greedy tokens per (grammar, prompt)."""
    instance = engine(checkpoint, None)
    answers = {}
    for name, grammar in GRAMMARS.items():
        done = serve(
            instance,
            PROMPTS,
            grammar=grammar,
            ignore_eos=False,
            max_tokens=MAX_TOKENS,
            logprobs=None,
        )
        for i, request in enumerate(done):
            answers[name, i] = request.output_token_ids
    return answers


@pytest.fixture(scope="module", params=sorted(MODES))
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, checkpoint: Path
) -> Iterator[tuple[str, ServeProcess]]:
    mode = request.param
    running = start_mode(tmp_path_factory.mktemp(f"structured-{mode}"), checkpoint, MODES[mode])
    try:
        yield mode, running
    finally:
        stop_group(running.process)


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    passage = [rng.randrange(10, 400) for _ in range(30)]
    return passage + passage[:8]  # a repeat for the n-gram drafter to find


PROMPTS = [_prompt(1), _prompt(2)]
GRAMMARS = {
    "schema": GrammarSpec.json_schema(SCHEMA),
    "choice": GrammarSpec.choices(CHOICES),
    "regex": GrammarSpec("regex", REGEX),
}
BODIES: dict[str, dict[str, Any]] = {
    "schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True},
        }
    },
    "choice": {"structured_outputs": {"choice": CHOICES}},
    "regex": {"guided_regex": REGEX},
}


def _tokens(choice: Any) -> list[int]:
    return [int(name.removeprefix("token_id:")) for name in choice.logprobs.tokens]


def test_structured_answers_follow_their_grammar_and_equal_the_engine(
    server: tuple[str, ServeProcess], checkpoint: Path, expected: dict[tuple[str, int], list[int]]
) -> None:
    mode, running = server
    client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=120)
    for name, body in BODIES.items():
        for i, ids in enumerate(PROMPTS):
            answer = client.completions.create(  # type: ignore[call-overload]
                model=checkpoint.name,
                prompt=ids,
                max_tokens=MAX_TOKENS,
                temperature=0,
                logprobs=0,
                extra_body=body | {"return_tokens_as_token_ids": True},
            )
            choice = answer.choices[0]
            assert choice.finish_reason == "stop", (mode, name, choice.text)
            assert _tokens(choice) == expected[name, i], (mode, name, i)
            text = choice.text
            if name == "schema":
                value = json.loads(text)
                assert value["color"] in {"red", "green", "blue"}
                assert isinstance(value["size"], int)
            elif name == "choice":
                assert text in CHOICES
            else:
                assert re.fullmatch(REGEX, text)


def test_required_tool_calls_come_back_as_tool_calls(
    server: tuple[str, ServeProcess], checkpoint: Path
) -> None:
    mode, running = server
    client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=120)
    tool = {
        "type": "function",
        "function": {
            "name": "pick",
            "parameters": {
                "type": "object",
                "properties": {"option": {"enum": ["left", "right"]}},
                "required": ["option"],
            },
        },
    }
    answer = client.chat.completions.create(
        model=checkpoint.name,
        messages=[{"role": "user", "content": "Pick a side."}],
        tools=[tool],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", mode
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "pick"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments)["option"] in {"left", "right"}  # type: ignore[union-attr]
