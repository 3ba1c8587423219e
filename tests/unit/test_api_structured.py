"""Structured output and tool calls at the HTTP edge (`cluster.api.structured`,
`cluster.api.tools`): every accepted spelling reaches the engine as one
`GrammarSpec`, bad constraints are 400s naming their field, and tool-call
outputs come back as `tool_calls`. The router here answers with scripted
text; what the grammar does to sampling is tested in test_grammar.py."""

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
from engine.grammar import GrammarSpec
from engine.messages import TokenEvent
from models.embedded.writer import write_checkpoint
from models.tokenizer import load_tokenizer

MODEL = "tiny-llama"
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "size": {"type": "integer"}},
    "required": ["color", "size"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


class _TextRouter:
    """Answers every request with the tokens of `answer`, one per event,
    ending with "stop"; records each request's params."""

    context: list[Any] = []
    generation: list[Any] = []

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.answer = "hello"
        self.params: list[Any] = []

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def generate(
        self, request_id: str, prompt: list[int], params: Any, images: Any = ()
    ) -> AsyncGenerator[TokenEvent, None]:
        self.params.append(params)
        ids = self.tokenizer.encode(self.answer, add_special_tokens=False)
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            yield TokenEvent(
                request_id,
                [token],
                num_prompt_tokens=len(prompt),
                finish_reason="stop" if last else None,
            )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> ServedModel:
    folder = write_checkpoint(tmp_path_factory.mktemp("served") / MODEL, "llama", "tiny")
    tokenizer = load_tokenizer(folder)
    return ServedModel(
        name=MODEL, tokenizer=tokenizer, max_model_len=256, vocab_size=tokenizer.vocab_size
    )


@pytest.fixture
def router(served: ServedModel) -> _TextRouter:
    return _TextRouter(served.tokenizer)


@pytest.fixture
def client(served: ServedModel, router: _TextRouter) -> Iterator[TestClient]:
    app = build_app(cast(Router, router), served, ServingMetrics(), ServerLimits())
    with TestClient(app) as test_client:
        yield test_client


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 8, **fields}


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({"response_format": {"type": "json_object"}}, GrammarSpec("json_object")),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}},
            GrammarSpec.json_schema(SCHEMA),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, GrammarSpec.json_schema(SCHEMA)),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, GrammarSpec("json_schema", json.dumps(SCHEMA))),
        ({"structured_outputs": {"json_object": True}}, GrammarSpec("json_object")),
        ({"structured_outputs": {"regex": "[0-9]+"}}, GrammarSpec("regex", "[0-9]+")),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, GrammarSpec.choices(["yes", "no"])),
        ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, GrammarSpec("ebnf", 'root ::= "a" | "b"')),
        ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, GrammarSpec.json_schema(SCHEMA)),
        ({"guided_regex": "a+"}, GrammarSpec("regex", "a+")),
        ({"guided_choice": ["x", "y"]}, GrammarSpec.choices(["x", "y"])),
        ({"guided_grammar": 'root ::= "z"'}, GrammarSpec("ebnf", 'root ::= "z"')),
        ({"response_format": {"type": "text"}}, None),
    ],
)  # fmt: skip
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_spelling_reaches_the_engine_as_one_grammar(
    client: TestClient, router: _TextRouter, fields: dict[str, Any], want: Any, endpoint: str
) -> None:
    body, path = (chat(**fields), "/v1/chat/completions")
    if endpoint == "completions":
        body, path = (completion(**fields), "/v1/completions")
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert router.params[-1].grammar == want


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "objectx"}}}},
         "response_format.json_schema.schema", 'Unsupported type "objectx"'),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "parenthesis is not closed"),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar",
         'Rule "undefined_rule" is not defined'),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not JSON"),
        ({"structured_outputs": {}}, "structured_outputs", "give one of"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
         "response_format and guided_regex both constrain"),
        ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend",
         "'outlines' is not available"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema"),
        ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos", "ends where its grammar does"),
    ],
)  # fmt: skip
def test_a_bad_constraint_is_a_400_naming_its_field(
    client: TestClient, fields: dict[str, Any], param: str, words: str
) -> None:
    response = client.post("/v1/chat/completions", json=chat(**fields))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param
    assert words in error["message"]
    assert "/project/" not in error["message"]  # xgrammar's source location is dropped


def test_an_unknown_response_format_field_is_refused_by_name(client: TestClient) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": {}, "oops": 1}}
    response = client.post("/v1/chat/completions", json=chat(response_format=fmt))
    assert response.status_code == 400 and "oops" in response.text


def test_required_tool_choice_constrains_to_calls_and_answers_with_tool_calls(
    client: TestClient, router: _TextRouter
) -> None:
    router.answer = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    body = chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    answer = client.post("/v1/chat/completions", json=body).json()
    schema = json.loads(router.params[-1].grammar.source)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [option["properties"]["name"]["enum"] for option in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {
        "type": "object",
        "properties": {},
    }
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_a_named_tool_choice_answers_with_its_arguments(
    client: TestClient, router: _TextRouter
) -> None:
    router.answer = '{"city": "Oslo"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = client.post(
        "/v1/chat/completions", json=chat(tools=[WEATHER], tool_choice=named)
    ).json()
    assert router.params[-1].grammar == GrammarSpec.json_schema(WEATHER["function"]["parameters"])  # type: ignore[index]
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_streamed_tool_calls_arrive_whole_in_the_last_chunk(
    client: TestClient, router: _TextRouter
) -> None:
    router.answer = '[{"name": "get_time", "parameters": {}}]'
    body = chat(tools=[WEATHER, TIME], tool_choice="required", stream=True)
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line)["choices"][0] for line in lines[:-1]]
    assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
    last = chunks[-1]
    assert last["finish_reason"] == "tool_calls"
    (call,) = last["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "get_time", "arguments": "{}"}
    assert all("content" not in c["delta"] for c in chunks[1:])


def test_an_output_cut_before_its_calls_end_comes_back_as_content(
    client: TestClient, router: _TextRouter
) -> None:
    router.answer = '[{"name": "get_ti'
    body = chat(tools=[TIME], tool_choice="required")
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": '[{"name": "get_ti'}


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tools": [WEATHER]}, "tool_choice", "'auto' (the default with tools)"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "this one does not"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "'required'"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", "'nope' is not among tools (get_weather)"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "unique"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "cannot constrain a tool call"),
    ],
)  # fmt: skip
def test_tool_choices_that_cannot_be_served_are_400s(
    client: TestClient, fields: dict[str, Any], param: str, words: str
) -> None:
    response = client.post("/v1/chat/completions", json=chat(**fields))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_no_tools_with_tool_choice_none_is_plain_text(
    client: TestClient, router: _TextRouter
) -> None:
    answer = client.post("/v1/chat/completions", json=chat(tool_choice="none")).json()
    assert answer["choices"][0]["message"]["content"] == "hello"
    assert router.params[-1].grammar is None


def test_earlier_tool_turns_reach_the_template(client: TestClient, router: _TextRouter) -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert response.status_code == 200, response.text


def test_auto_tool_choice_says_when_the_template_declares_tool_calls() -> None:
    from cluster.api.tools import ToolDefinition, ToolError, declares_tools, tool_calling

    template = (
        "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}{{ tools }}{% endif %}"
    )
    assert declares_tools(template) and not declares_tools("{{ messages }}")
    with pytest.raises(ToolError, match="declares tool calls, but this server does not parse"):
        tool_calling(
            [ToolDefinition.model_validate(WEATHER)], "auto", None, declares_tools(template)
        )
