"""`n` choices through the HTTP server (`cluster.api`), fed by a scripted
router whose events carry each sample's index as the engine sends them."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Iterator
from typing import Any, cast

import pytest
from fastapi.testclient import TestClient

from cluster.api.request_prep import ServedModel
from cluster.api.server import ServerLimits, build_app
from cluster.metrics import ServingMetrics
from cluster.routing.router import Router
from engine.messages import TokenEvent
from models.embedded.writer import write_checkpoint
from models.tokenizer import load_tokenizer

MODEL = "tiny-llama"


class _SampleRouter:
    """Answers every request with `n` samples: sample i's tokens are
    [10 + i, 20 + i, ...], `max_tokens` of them, interleaved step by step;
    every sample but the last to end says so in `sample_finish_reason`."""

    context: list[Any] = []
    generation: list[Any] = []

    def __init__(self) -> None:
        self.requests: list[tuple[str, list[int], Any]] = []

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def generate(
        self, request_id: str, prompt: list[int], params: Any, images: Any = ()
    ) -> AsyncGenerator[TokenEvent, None]:
        self.requests.append((request_id, prompt, params))
        n, steps = params.n, params.max_tokens
        for step in range(steps):
            for sample in range(n):
                last_step = step == steps - 1
                reason = "length" if last_step else None
                ends = last_step and sample == n - 1
                yield TokenEvent(
                    request_id,
                    [10 * (step + 1) + sample + len(prompt) % 7],
                    num_prompt_tokens=len(prompt),
                    sample=sample,
                    finish_reason=reason if ends else None,
                    sample_finish_reason=None if ends else reason,
                )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> ServedModel:
    folder = write_checkpoint(tmp_path_factory.mktemp("served") / MODEL, "llama", "tiny")
    tokenizer = load_tokenizer(folder)
    return ServedModel(
        name=MODEL, tokenizer=tokenizer, max_model_len=256, vocab_size=tokenizer.vocab_size
    )


@pytest.fixture
def router() -> _SampleRouter:
    return _SampleRouter()


@pytest.fixture
def client(served: ServedModel, router: _SampleRouter) -> Iterator[TestClient]:
    app = build_app(cast(Router, router), served, ServingMetrics(), ServerLimits())
    with TestClient(app) as test_client:
        yield test_client


def test_n_choices_are_indexed_and_the_prompt_counted_once(
    client: TestClient, router: _SampleRouter, served: ServedModel
) -> None:
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "n": 3}
    answer = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in answer["choices"])
    decode = served.tokenizer.decode
    for c in answer["choices"]:
        i = c["index"]
        assert c["text"] == decode([5, 6, 7, 13 + i, 23 + i, 33 + i])[len(decode([5, 6, 7])) :]
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}
    assert len(router.requests) == 1 and router.requests[0][2].n == 3


def test_streamed_chunks_carry_their_choice_index_and_the_usage_sums(client: TestClient) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    choices = [chunk["choices"][0] for chunk in chunks if chunk["choices"]]
    roles = [c["index"] for c in choices if c["delta"].get("role") == "assistant"]
    assert roles == [0, 1]
    finishes = {c["index"]: c["finish_reason"] for c in choices if c["finish_reason"]}
    assert finishes == {0: "length", 1: "length"}
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 4 and usage["prompt_tokens"] > 0


def test_a_prompt_list_with_n_indexes_prompt_times_n_plus_sample(
    client: TestClient, router: _SampleRouter
) -> None:
    body = {"model": MODEL, "prompt": [[5, 6], [7, 8, 9]], "max_tokens": 2, "n": 2}
    answer = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
    assert sorted(len(prompt) for _, prompt, _ in router.requests) == [2, 3]


def test_n_past_the_limit_and_best_of_other_than_n_are_400s(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 17})
    assert response.status_code == 400 and "between 1 and 16" in response.text
    body = {"model": MODEL, "prompt": "x", "n": 2, "best_of": 4}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "best_of"
    body["best_of"] = 2
    assert client.post("/v1/completions", json=body).status_code == 200
