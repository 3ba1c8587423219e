"""The HTTP server's own routes and refusals, through `build_app` itself.

The router stands idle: every request here is answered (or refused) before
a worker would see it, so no Ray cluster is needed. Completions that reach
the workers are checked in tests/integration/test_serve_openai.py.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Iterator
from typing import Any, cast

import pytest
from fastapi.testclient import TestClient

from cluster.api.request_prep import ServedModel
from cluster.api.server import ServerLimits, build_app
from cluster.metrics import ServingMetrics
from cluster.routing.router import Router
from models.embedded.writer import write_checkpoint
from models.tokenizer import load_tokenizer

MODEL = "tiny-llama"
MAX_MODEL_LEN = 64
KEY = "sk-test"


class _IdleRouter:
    """What the app asks of a router before any request reaches a worker."""

    context: list[Any] = []
    generation: list[Any] = []

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> ServedModel:
    folder = write_checkpoint(tmp_path_factory.mktemp("served") / MODEL, "llama", "tiny")
    tokenizer = load_tokenizer(folder)
    return ServedModel(
        name=MODEL,
        tokenizer=tokenizer,
        max_model_len=MAX_MODEL_LEN,
        vocab_size=tokenizer.vocab_size,
        aliases=(str(folder),),
    )


@pytest.fixture
def metrics() -> ServingMetrics:
    return ServingMetrics()


@pytest.fixture
def client(served: ServedModel, metrics: ServingMetrics) -> Iterator[TestClient]:
    limits = ServerLimits(api_key=KEY, max_body_bytes=4096, max_queued_requests=1)
    app = build_app(cast(Router, _IdleRouter()), served, metrics, limits)
    headers = {"Authorization": f"Bearer {KEY}"}
    with TestClient(app, headers=headers) as test_client:
        yield test_client


def _error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


def test_a_model_card_is_retrieved_by_id_and_an_unknown_id_is_an_openai_404(
    client: TestClient, served: ServedModel
) -> None:
    card = client.get(f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "disagg"
    assert card == client.get("/v1/models").json()["data"][0]
    # An alias with slashes in it (the checkpoint path) names the same model.
    assert client.get(f"/v1/models/{served.aliases[0]}").json()["id"] == MODEL
    error = _error(client.get("/v1/models/gpt-4o"), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert (
        error["type"] == "invalid_request_error" and "'gpt-4o' does not exist" in (error["message"])
    )


def test_tokenize_and_detokenize_round_trip_in_vllms_shapes(
    client: TestClient, served: ServedModel
) -> None:
    text = "Once upon a time"
    answer = client.post("/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert answer["tokens"] == served.tokenizer.encode(text, add_special_tokens=True)
    assert answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == MAX_MODEL_LEN
    assert client.post("/detokenize", json={"tokens": answer["tokens"]}).json() == {
        "prompt": served.tokenizer.decode(answer["tokens"], skip_special_tokens=False)
    }
    strs = client.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert len(strs["token_strs"]) == strs["count"]
    messages = [{"role": "user", "content": "Hi there"}]
    chat = client.post("/tokenize", json={"messages": messages}).json()
    rendered = served.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = served.tokenizer.encode(rendered, add_special_tokens=False)
    assert chat["tokens"] == ids and chat["count"] == len(ids)
    assert client.get("/version").json() == {"version": importlib.metadata.version("disagg")}


BAD_REQUESTS: dict[str, tuple[str, dict[str, Any], int, str]] = {
    # name: (route, request keyword arguments, status, code)
    "unknown parameter": ("/v1/completions", {"json": {"model": MODEL, "max_tokns": 3}}, 400, ""),
    "out of range": (
        "/v1/completions",
        {"json": {"model": MODEL, "prompt": "x", "temperature": 3}},
        400,
        "less_than_equal",
    ),
    "token id past the vocabulary": (
        "/v1/completions",
        {"json": {"model": MODEL, "prompt": [10**6]}},
        400,
        "invalid_value",
    ),
    "prompt too long": (
        "/v1/completions",
        {"json": {"model": MODEL, "prompt": [5] * MAX_MODEL_LEN}},
        400,
        "context_length_exceeded",
    ),
    "two inputs to tokenize": (
        "/tokenize",
        {"json": {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}},
        400,
        "value_error",
    ),
    "ids past the vocabulary to detokenize": (
        "/detokenize",
        {"json": {"tokens": [10**6]}},
        400,
        "invalid_value",
    ),
    "broken JSON": (
        "/v1/completions",
        {"content": b"{", "headers": {"content-type": "application/json"}},
        400,
        "json_invalid",
    ),
    "unknown model": ("/v1/completions", {"json": {"model": "other", "prompt": "x"}}, 404, ""),
    "unknown route": ("/v1/embeddings", {"json": {"model": MODEL}}, 404, "unknown_route"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_every_refusal_has_a_code_and_a_message_of_ours(client: TestClient, case: str) -> None:
    route, request, status, code = BAD_REQUESTS[case]
    error = _error(client.post(route, **request), status)
    assert isinstance(error["code"], str) and error["code"], error
    assert code in error["code"]
    assert not error["message"].startswith("Value error"), error
    assert "Value error," not in error["message"], error


def test_a_wrong_method_is_a_405_with_a_code(client: TestClient) -> None:
    error = _error(client.get("/v1/completions"), 405)
    assert error["code"] == "method_not_allowed"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_json_without_its_content_type_says_what_header_to_send(
    client: TestClient, content_type: str | None
) -> None:
    """What `curl -d '{...}'` sends without `-H 'Content-Type: application/json'`."""
    headers = {} if content_type is None else {"content-type": content_type}
    body = b'{"model": "tiny-llama", "prompt": "x"}'
    for route in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        error = _error(client.post(route, content=body, headers=headers), 400)
        assert "Content-Type: application/json" in error["message"], error
        assert "valid dictionary" not in error["message"], error
        assert error["code"] == "invalid_body"


def _refused(metrics: ServingMetrics) -> dict[tuple[str, str], float]:
    text = metrics.exposition().decode()
    pattern = r'disagg_error_responses_total\{code="([^"]+)",status="(\d+)"\} (\S+)'
    return {(status, code): float(n) for code, status, n in re.findall(pattern, text)}


def test_metrics_count_every_refusal_by_status_and_code(
    client: TestClient, metrics: ServingMetrics
) -> None:
    client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 0})
    client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 0})
    client.post("/v1/completions", json={"model": "other", "prompt": "x"})
    client.post("/v1/completions", json={"model": MODEL, "prompt": [10**6]})
    client.post("/v1/completions", json={"model": MODEL}, headers={"Authorization": "Bearer no"})
    client.post("/v1/completions", content=b"x" * 5000, headers={"content-type": "text/plain"})
    client.get("/nowhere")
    # /metrics itself is scraped from the same app.
    assert "disagg_error_responses_total" in client.get("/metrics").text
    assert _refused(metrics) == {
        ("400", "greater_than"): 2,
        ("404", "model_not_found"): 1,
        ("400", "invalid_value"): 1,
        ("401", "invalid_api_key"): 1,
        ("413", "request_too_large"): 1,
        ("404", "unknown_route"): 1,
    }
