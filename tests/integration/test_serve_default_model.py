"""`disagg serve` with no config: the packaged SmolLM2-135M-Instruct in 1P1D.

The server (Python transceiver, fp32) converts the packaged GGUF file into a
cache folder under this test's tmp dir; its chat answers at temperature 0
must be transformers' greedy `generate` on that same dequantized folder,
token for token. Kept lean: 30 layers at fp32 on a shared CPU.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.serve_process import ServeProcess
from cluster.config.default_model import default_model_file
from models.checkpoint_source import checkpoint_folder
from models.gguf.cache import CACHE_ENV
from models.tokenizer import load_tokenizer

QUESTIONS = ("What is the capital of France?", "Name three primary colors.")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-cache")


@pytest.fixture(scope="module")
def server(cache_dir: Path) -> Iterator[ServeProcess]:
    args = ("--host", "127.0.0.1", "--port", "0")
    with ServeProcess(None, args, env={CACHE_ENV: str(cache_dir)}) as process:
        yield process


def test_chat_answers_equal_transformers_greedy_on_the_same_weights(
    server: ServeProcess, cache_dir: Path
) -> None:
    assert any("SmolLM2-135M-Instruct" in line for line in server.output)
    # The folder the server converted: resolving again finds it in the cache.
    folder = checkpoint_folder(default_model_file(), cache_dir=cache_dir, progress=False)
    tokenizer = load_tokenizer(folder)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct.Q4_1"
    answers = []
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer.encode_chat(messages)
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False
            )
        expected = out[0, len(prompt) :].tolist()  # with the end-of-turn token, if reached
        answer = client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=True,
        )
        choice = answer.choices[0]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        served = [bytes(entry.bytes or []) for entry in choice.logprobs.content]
        assert served == [tokenizer.token_bytes(t) for t in expected], question
        assert choice.message.content == tokenizer.decode(expected)
        answers.append(choice.message.content)
    assert "Paris" in answers[0]  # a real model, not random weights


def test_structured_output_on_the_default_model(server: ServeProcess) -> None:
    """What a new user's client sends: a JSON schema with an enum and an
    integer, any JSON object, and vLLM's choice list, answered by a real
    model through 1P1D."""
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    schema = {
        "type": "object",
        "properties": {
            "color": {"type": "string", "enum": ["red", "green", "blue"]},
            "count": {"type": "integer"},
        },
        "required": ["color", "count"],
    }

    def ask(question: str, **fields: Any) -> Any:
        answer = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            max_tokens=48,
            temperature=0,
            **fields,
        )
        return answer.choices[0]

    fmt = {"type": "json_schema", "json_schema": {"name": "ball", "schema": schema, "strict": True}}
    choice = ask("Describe a ball as JSON with a color and a count.", response_format=fmt)
    value = json.loads(choice.message.content)
    assert value["color"] in {"red", "green", "blue"} and isinstance(value["count"], int)
    assert set(value) == {"color", "count"} and choice.finish_reason == "stop"

    choice = ask("Give me a JSON object describing Paris.", response_format={"type": "json_object"})
    assert isinstance(json.loads(choice.message.content), dict)

    options = ["Paris", "London", "Rome"]
    choice = ask("Which city is in Italy?", extra_body={"structured_outputs": {"choice": options}})
    assert choice.message.content in options
