"""Request validation and response shapes of the OpenAI-compatible API (pure)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from pydantic import ValidationError

from cluster.api.api_errors import APIError, handle_validation_error, validation_error
from cluster.api.completion import Delta
from cluster.api.openai_format import (
    ChunkWriter,
    ResponseMeta,
    chat_choice,
    chat_chunk,
    chat_logprobs,
    completion_choice,
    completion_chunk,
    completion_logprobs,
    merge,
    sse,
    usage,
)
from cluster.api.protocol import ChatCompletionRequest, CompletionRequest
from cluster.api.stop_strings import StopStringFilter
from models.embedded.writer import write_checkpoint
from models.tokenizer import load_tokenizer


def _errors(model: type, body: dict[str, Any]) -> list[Any]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return info.value.errors()


def _validating_app() -> FastAPI:
    """A FastAPI app with the server's validation handler and one body model."""
    app = FastAPI()
    app.add_exception_handler(RequestValidationError, handle_validation_error)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> dict[str, str]:
        return {"ok": body.model}

    return app


def test_unknown_parameter_is_a_400_naming_it() -> None:
    error = validation_error(
        _errors(CompletionRequest, {"model": "m", "prompt": "x", "max_tokns": 3})
    )
    assert error.status == 400
    body = error.body()["error"]
    assert body["param"] == "max_tokns"
    assert body["type"] == "invalid_request_error"
    assert "unknown parameter" in body["message"]


def test_out_of_range_values_name_the_field() -> None:
    cases = [
        ({"temperature": 3.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"n": 2, "best_of": 3}, "best_of"),
        ({"logprobs": 99}, "logprobs"),
        ({"top_k": 2**70}, "top_k"),
        ({"stop_token_ids": [7, -1]}, "stop_token_ids"),
    ]
    for extra, field in cases:
        body = {"model": "m", "prompt": "x", **extra}
        assert validation_error(_errors(CompletionRequest, body)).param == field


def test_more_than_one_choice_and_broken_json_have_clear_messages() -> None:
    error = validation_error(_errors(CompletionRequest, {"model": "m", "prompt": "x", "n": 17}))
    assert (error.param, error.status) == ("n", 400)
    assert "n must be between 1 and 16" in error.message
    for fields in ({"n": 3}, {"n": 3, "best_of": 3}):
        assert CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields}).n == 3
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 16}
    assert ChatCompletionRequest.model_validate(chat).n == 16
    app = _validating_app()
    response = TestClient(app).post(
        "/v1/completions", content=b"not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] is None
    assert "not valid JSON" in response.json()["error"]["message"]
    # JSON sent as text/plain (curl -d without -H): say what to send.
    response = TestClient(app).post(
        "/v1/completions",
        content=b'{"model": "m", "prompt": "x"}',
        headers={"content-type": "text/plain"},
    )
    assert response.status_code == 400
    assert "Content-Type: application/json" in response.json()["error"]["message"]
    # A validator's message comes without pydantic's "Value error," prefix.
    response = TestClient(app).post("/v1/completions", json={"model": "m", "prompt": "x", "n": 30})
    assert response.json()["error"]["message"].startswith("n: n must be between 1 and 16")


def test_a_seed_must_fit_64_bits() -> None:
    for seed in (2**63, -(2**63) - 1, 2**80):
        body = {"model": "m", "prompt": "x", "seed": seed}
        assert validation_error(_errors(CompletionRequest, body)).param == "seed"
    for seed in (-(2**63), 2**63 - 1):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "seed": seed})


def test_text_with_an_unpaired_surrogate_escape_is_refused_naming_the_field() -> None:
    lone = json.loads('"ab\\ud800"')  # what a JSON body's "ab\ud800" decodes to
    pair = json.loads('"\\ud83d\\ude00"')  # a surrogate pair is one character: fine
    completions = [({"prompt": lone}, "prompt"), ({"prompt": "x", "stop": [lone]}, "stop")]
    for fields, param in completions:
        error = validation_error(_errors(CompletionRequest, {"model": "m", **fields}))
        assert error.param == param and "unpaired surrogate" in error.message
    CompletionRequest.model_validate({"model": "m", "prompt": pair, "stop": pair})
    messages = [
        ({"role": "user", "content": lone}, "messages.0.content"),
        ({"role": "user", "content": [{"type": "text", "text": lone}]}, "messages.0.content"),
        ({"role": "user", "content": "x", "name": lone}, "messages.0.name"),
    ]
    for message, param in messages:
        body = {"model": "m", "messages": [message]}
        error = validation_error(_errors(ChatCompletionRequest, body))
        assert error.param.startswith(param) and "unpaired surrogate" in error.message


def test_missing_prompt_and_empty_prompt_are_rejected() -> None:
    missing = validation_error(_errors(CompletionRequest, {"model": "m"}))
    assert (missing.param, missing.code) == ("prompt", "missing")
    empty = validation_error(_errors(CompletionRequest, {"model": "m", "prompt": ""}))
    assert empty.param == "prompt" and "must not be empty" in empty.message


def test_a_list_of_prompts_is_taken_whole_and_its_misshapes_named() -> None:
    listed = CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"]})
    assert listed.prompt_list() == ["a", "b"]
    ids = CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2], [3]]})
    assert ids.prompt_list() == [[1, 2], [3]]
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]}).prompt_list() is None
    cases = [
        ({"prompt": ["a", [1]]}, "all strings or all token-id lists"),
        ({"prompt": ["a", ""]}, "prompt 1: prompt must not be empty"),
        ({"prompt": [[1], [-1]]}, "prompt 1: prompt token ids must be non-negative"),
        ({"prompt": ["a"] * 65}, "at most 64 prompts"),
        ({"prompt": ["a", "b"], "stream": True}, "answered whole"),
    ]
    for extra, message in cases:
        error = validation_error(_errors(CompletionRequest, {"model": "m", **extra}))
        assert message in error.message, (extra, error.message)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt": [{"type": "image_url", "image_url": {"url": "data:,"}}]}, "prompt"),
        ({"prompt": "x", "multi_modal_data": {"image": "cat.png"}}, "multi_modal_data"),
    ],
)
def test_images_on_completions_are_refused_naming_chat_completions(
    extra: dict[str, Any], param: str
) -> None:
    error = validation_error(_errors(CompletionRequest, {"model": "m", **extra}))
    assert (error.status, error.param) == (400, param)
    assert "/v1/chat/completions" in error.message


def test_completion_prompt_may_be_token_ids() -> None:
    request = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3]})
    assert request.prompt == [1, 2, 3]
    assert request.max_tokens == 16  # OpenAI's default for completions


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([1, True, 3], "a list of token ids, or a list of either"),
        ([1, 2.0], "a list of token ids, or a list of either"),
        ([4, -1, 2], "must be non-negative"),
        ([], "must not be empty"),
    ],
)
def test_a_token_id_prompt_holds_only_non_negative_ints(prompt: list[Any], message: str) -> None:
    error = validation_error(_errors(CompletionRequest, {"model": "m", "prompt": prompt}))
    assert error.param == "prompt" and message in error.message


def test_stream_options_need_stream_and_stop_accepts_str_or_list() -> None:
    errors = _errors(
        CompletionRequest,
        {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}},
    )
    assert "only allowed when stream is true" in validation_error(errors).message
    one = CompletionRequest.model_validate({"model": "m", "prompt": "x", "stop": "END"})
    many = CompletionRequest.model_validate({"model": "m", "prompt": "x", "stop": ["a", "b"]})
    assert (one.stop_strings, many.stop_strings) == (["END"], ["a", "b"])


def test_chat_messages_render_text_parts_and_take_max_completion_tokens() -> None:
    request = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
                },
            ],
            "max_completion_tokens": 7,
        }
    )
    assert request.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi there"},
    ]
    assert request.output_limit == 7


def test_chat_rejects_bad_roles_empty_messages_and_orphan_top_logprobs() -> None:
    bad_role = {"model": "m", "messages": [{"role": "robot", "content": "x"}]}
    assert validation_error(_errors(ChatCompletionRequest, bad_role)).param == "messages.0.role"
    assert validation_error(
        _errors(ChatCompletionRequest, {"model": "m", "messages": []})
    ).param == ("messages")
    orphan = {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    assert "needs logprobs" in validation_error(_errors(ChatCompletionRequest, orphan)).message


def test_fastapi_validation_errors_become_openai_400s() -> None:
    app = _validating_app()
    client = TestClient(app)
    response = client.post("/v1/completions", json={"model": "m", "prompt": "x", "top_k": -5})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "top_k"
    assert client.post("/v1/completions", json={"model": "m", "prompt": "x"}).status_code == 200


def test_api_error_body_has_the_openai_shape() -> None:
    body = APIError(404, "no such model", param="model", code="model_not_found").body()
    assert body == {
        "error": {
            "message": "no such model",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


def test_stop_string_split_across_deltas_is_cut_before_it() -> None:
    stops = StopStringFilter(["END"])
    assert [stops.add(d) for d in ("ab", "cE", "N", "D!")] == ["ab", "c", "", ""]
    assert stops.stopped and stops.finish() == ""


def test_stop_string_prefix_that_does_not_complete_is_released() -> None:
    stops = StopStringFilter(["END"])
    assert stops.add("xE") == "x"
    assert stops.add("Nz") == "ENz"
    assert stops.add("E") == ""
    assert stops.finish() == "E"
    assert not stops.stopped


def test_include_stop_str_keeps_the_stop_string_and_earliest_stop_wins() -> None:
    stops = StopStringFilter(["world", "lo"], include_stop=True)
    assert stops.add("hello world") == "hello"
    assert stops.stopped


@pytest.mark.parametrize("include", [False, True])
def test_stop_filter_output_is_the_whole_text_cut_at_the_first_stop(include: bool) -> None:
    """Random texts, stop strings and delta boundaries: the client sees the
    text up to the stop string that ends first (the first listed on a tie),
    as the workers stop, however the deltas split it."""
    rng = random.Random(7)
    for _ in range(500):
        stops = ["".join(rng.choice("ab#") for _ in range(rng.randint(1, 4))) for _ in range(2)]
        text = "".join(rng.choice("ab#xy") for _ in range(rng.randint(0, 60)))
        matches = [(at + len(s), at) for s in stops if (at := text.find(s)) != -1]
        expected = text
        if matches:
            end, start = min(matches, key=lambda match: match[0])  # min keeps the first on ties
            expected = text[: end if include else start]
        stop_filter = StopStringFilter(stops, include_stop=include)
        out, at = [], 0
        while at < len(text):
            step = rng.randint(1, 5)
            out.append(stop_filter.add(text[at : at + step]))
            at += step
        out.append(stop_filter.finish())
        assert "".join(out) == expected, (stops, text)


def test_merged_deltas_give_text_usage_and_logprob_offsets() -> None:
    deltas = [
        Delta("ab", [1], logprobs=[-0.5], num_prompt_tokens=4, num_output_tokens=1),
        Delta(
            "c",
            [2],
            logprobs=[-1.0],
            finish_reason="stop",
            num_prompt_tokens=4,
            num_output_tokens=2,
        ),
    ]
    whole = merge(deltas)
    assert (whole.text, whole.token_ids, whole.finish_reason) == ("abc", [1, 2], "stop")
    assert usage(whole) == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}

    class Letters:
        def token_bytes(self, token_id: int) -> bytes:
            return "xyz"[token_id].encode()

    logprobs = completion_logprobs(whole, Letters(), 0, 10)
    assert logprobs is not None
    assert logprobs["tokens"] == ["y", "z"]
    assert logprobs["token_logprobs"] == [-0.5, -1.0]
    assert logprobs["text_offset"] == [10, 11]
    # return_tokens_as_token_ids: the same logprobs, each token named by its id.
    by_id = completion_logprobs(whole, Letters(), 0, 10, as_ids=True)
    assert by_id is not None and by_id["tokens"] == ["token_id:1", "token_id:2"]
    chat = chat_logprobs(whole, Letters(), 0, as_ids=True)
    assert chat is not None and [e["token"] for e in chat["content"]] == [
        "token_id:1",
        "token_id:2",
    ]


def test_logprobs_show_a_token_with_part_of_a_character_as_its_bytes(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "llama", "tiny")
    tokenizer = load_tokenizer(tmp_path)
    ids = tokenizer.encode("a—b", add_special_tokens=False)
    raw = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(raw) == "a—b".encode()
    assert any(not _utf8(b) for b in raw), "the tiny vocabulary should split the 3-byte dash"
    delta = Delta("", ids, logprobs=[-0.1] * len(ids), top_logprobs=[[(i, -0.1)] for i in ids])
    completion = completion_logprobs(delta, tokenizer, 1, 0)
    assert completion is not None
    # "—" is 3 bytes; whichever tokens split it show as bytes:, whole ones as text.
    shown = completion["tokens"]
    for token, b in zip(shown, raw, strict=True):
        if _utf8(b):
            assert token == b.decode()
        else:
            assert token == "bytes:" + "".join(f"\\x{x:02x}" for x in b)
    assert (
        completion["text_offset"][0] == 0 and completion["text_offset"][-1] == 2
    )  # "a—" is 2 chars
    chat = chat_logprobs(delta, tokenizer, 1)
    assert chat is not None
    assert [entry["bytes"] for entry in chat["content"]] == [list(b) for b in raw]
    assert chat["content"][0]["top_logprobs"][0]["bytes"] == list(raw[0])


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_chat_chunk_has_the_openai_chunk_shape() -> None:
    chunk = chat_chunk(ResponseMeta("id-1", 5, "m"), {"content": "hi"}, None)
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"] == [
        {"index": 0, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None}
    ]


def test_chunk_writer_lines_equal_the_whole_chunk_serialized() -> None:
    meta = ResponseMeta('cmpl-"x"', 5, "m/é")  # quotes and non-ASCII survive the template
    text = ChunkWriter(meta, "text_completion")
    assert text.line(completion_choice('a "b"\n', "stop", None)) == sse(
        completion_chunk(meta, 'a "b"\n', "stop", None)
    )
    chat = ChunkWriter(meta, "chat.completion.chunk")
    assert chat.line(chat_choice({"content": "hi"}, None)) == sse(
        chat_chunk(meta, {"content": "hi"}, None)
    )
    for body, finish in (('a "b"\n', None), ("", "length"), ("€\u2028\\", "stop")):
        assert text.text_line(body, finish) == sse(completion_chunk(meta, body, finish, None))
        content = {"content": body} if body else {}
        assert chat.content_line(body, finish) == sse(chat_chunk(meta, content, finish))
        # The shared encoder writes what json.dumps does with compact separators.
        whole = completion_chunk(meta, body, finish, None)
        assert (
            text.text_line(body, finish) == f"data: {json.dumps(whole, separators=(',', ':'))}\n\n"
        )
