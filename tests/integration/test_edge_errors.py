"""Bad requests at the HTTP edge of a running `disagg serve` (API key on).

Every malformed or out-of-range request gets a 4xx in OpenAI's error shape
naming the offending field, and the server keeps serving: a valid request
after all of them still completes. One 1P1D server on a tiny checkpoint for
the whole module, its key given through `DISAGG_API_KEY`, from a config in
TensorRT-LLM's keys (tests/configs/trtllm/1p1d-python-small-cache.yaml);
its greedy completions equal transformers' on the same checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import yaml

from benchmarks.serve_process import ServeProcess

API_KEY = "sk-edge-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CACHE_TOKENS = 256
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "trtllm" / "1p1d-python-small-cache.yaml"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.embedded.writer import ensure_checkpoint

    return ensure_checkpoint(tmp_path_factory.mktemp("edge") / "tiny-llama", "llama", "tiny")


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[ServeProcess]:
    assert yaml.safe_load(CONFIG.read_text())["kv_cache_config"]["max_tokens"] == CACHE_TOKENS
    args = ("--model", str(checkpoint), "--port", "0")
    with ServeProcess(CONFIG, args, env={"DISAGG_API_KEY": API_KEY}) as running:
        yield running


@pytest.fixture(scope="module")
def http(server: ServeProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def limits(http: httpx.Client) -> dict[str, Any]:
    card = http.get("/models").json()["data"][0]
    return {"model": card["id"], "max_model_len": card["max_model_len"]}


def _assert_error(response: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    if param is not None:
        assert param.split(".")[0] in error["message"], error
    return dict(error)


def _completion(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "Hello", "max_tokens": 2} | fields


# (overrides of a valid completion body, the field the error must name)
FIELD_CASES: list[tuple[dict[str, Any], str]] = [
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"n": 17}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": ["a", [1]]}, "prompt"),
    ({"stream": "yes"}, "stream"),
    ({"logprobs": 100}, "logprobs"),
]


def test_each_invalid_field_is_a_400_naming_it(http: httpx.Client, limits: dict[str, Any]) -> None:
    for overrides, param in FIELD_CASES:
        response = http.post("/completions", json=_completion(limits["model"], **overrides))
        _assert_error(response, 400, param)


def test_chat_without_messages_or_with_a_bad_role_names_messages(
    http: httpx.Client, limits: dict[str, Any]
) -> None:
    model = limits["model"]
    _assert_error(
        http.post("/chat/completions", json={"model": model, "messages": []}), 400, "messages"
    )
    bad_role = {"model": model, "messages": [{"role": "robot", "content": "hi"}]}
    error = _assert_error(http.post("/chat/completions", json=bad_role), 400, "messages.0.role")
    assert "robot" in error["message"] or "system" in error["message"]


def test_unknown_model_is_a_404_naming_model(http: httpx.Client) -> None:
    response = http.post("/completions", json=_completion("no-such-model"))
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["param"] == "model" and error["code"] == "model_not_found"


def test_prompts_and_outputs_past_the_model_length_are_refused(
    http: httpx.Client, limits: dict[str, Any]
) -> None:
    model, limit = limits["model"], limits["max_model_len"]
    assert limit <= CACHE_TOKENS  # the cache, not the model, is the bound here
    too_long = _completion(model, prompt=[5] * limit)
    error = _assert_error(http.post("/completions", json=too_long), 400, "prompt")
    assert error["code"] == "context_length_exceeded" and str(limit) in error["message"]
    no_room = _completion(model, prompt=[5] * (limit - 4), max_tokens=5)
    error = _assert_error(http.post("/completions", json=no_room), 400, "max_tokens")
    assert error["code"] == "context_length_exceeded"
    huge = _completion(model, max_tokens=10**9)
    _assert_error(http.post("/completions", json=huge), 400, "max_tokens")


def test_broken_bodies_are_400_or_413(http: httpx.Client, limits: dict[str, Any]) -> None:
    json_header = {"Content-Type": "application/json"}
    broken = http.post("/completions", content=b'{"model": "x", "prompt": ', headers=json_header)
    assert _assert_error(broken, 400, None)["code"] == "json_invalid"
    body = f'{{"model": "{limits["model"]}", "prompt": "\xff\xfe"}}'.encode("latin-1")
    not_utf8 = http.post("/completions", content=body, headers=json_header)
    assert "UTF-8" in _assert_error(not_utf8, 400, None)["message"]
    oversize = _completion(limits["model"], prompt="x" * (1 << 20))
    error = _assert_error(http.post("/completions", json=oversize), 413, None)
    assert error["code"] == "request_too_large"


def test_the_api_needs_the_key_but_health_and_metrics_do_not(server: ServeProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        response = anonymous.get("/models")
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        wrong = anonymous.get("/models", headers={"Authorization": "Bearer wrong"})
        assert wrong.status_code == 401
        root = server.url.removesuffix("/v1")
        assert anonymous.get(root + "/health").status_code == 200
        assert anonymous.get(root + "/metrics").status_code == 200
    client = openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_the_server_keeps_serving_after_bad_requests(
    server: ServeProcess, limits: dict[str, Any]
) -> None:
    client = openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)
    completion = client.completions.create(
        model=limits["model"], prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    stream = client.completions.create(
        model=limits["model"], prompt="Hello", max_tokens=3, stream=True, temperature=0
    )
    assert [c.choices[0].finish_reason for c in stream][-1] == "length"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=limits["model"], prompt="x", max_tokens=2, top_p=2.0)
    assert info.value.body is not None and info.value.body["param"] == "top_p"  # type: ignore[index]
    assert server.process is not None and server.process.poll() is None


def test_greedy_completions_equal_transformers_generate(
    server: ServeProcess, checkpoint: Path, limits: dict[str, Any]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    client = openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)
    for prompt in ("The quick brown fox", "Once upon a time, in a small village"):
        ids = torch.tensor([tokenizer(prompt).input_ids])
        with torch.no_grad():
            out = reference.generate(ids, max_new_tokens=8, do_sample=False)
        reply = client.completions.create(
            model=limits["model"], prompt=prompt, max_tokens=8, temperature=0
        )
        assert reply.choices[0].text == tokenizer.decode(
            out[0, ids.shape[1] :], skip_special_tokens=True
        )
