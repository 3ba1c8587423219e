"""Tool calls on `/v1/chat/completions`: `tools` with a `tool_choice` that
makes the model call one, constrained by the functions' parameter schemas.

- `tool_choice: "required"`: the output is a JSON list of one or more calls
  `[{"name": ..., "parameters": {...}}]`, each name one of `tools`' and its
  parameters valid for that function's schema (one call at most with
  `parallel_tool_calls: false`);
- `tool_choice: {"type": "function", "function": {"name": ...}}`: the output
  is that function's arguments, valid for its schema;
- `tool_choice: "none"`, or no tools: plain text.

Either way the answer carries `tool_calls` (ids `call_<hex>`, arguments as
JSON text) and no content. `tool_choice: "auto"` (OpenAI's default when
tools are sent) would need the model to choose between text and a call in
its own tool-call syntax, parsed out of free text, which this server does
not do: it is refused by name, the message saying whether the model's
template declares tool calls at all. The tools are passed to the chat template as `tools`,
for templates that render them; assistant `tool_calls` and `tool`
messages of earlier turns reach it as sent.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.grammar import GrammarSpec

# What a function's schema is when it declares no parameters.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str


class ToolCall(BaseModel):
    """A call of an earlier assistant turn, as a client sends it back."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"]
    function: CalledFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolError(ValueError):
    """Tools the request cannot have; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class ToolCalling:
    """How a request's output becomes tool calls: a list of calls
    (`required`) or one named function's arguments."""

    grammar: GrammarSpec
    function: str | None = None  # the named function; None: a list of calls

    def message(self, text: str) -> dict[str, Any] | None:
        """The assistant message of a finished output, or None when the
        text is not whole calls (cut by max_tokens)."""
        if self.function is not None:
            try:
                json.loads(text)
            except ValueError:
                return None
            calls = [(self.function, text)]
        else:
            try:
                listed = json.loads(text)
                calls = [(c["name"], json.dumps(c["parameters"])) for c in listed]
            except (ValueError, TypeError, KeyError):
                return None
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
                for name, arguments in calls
            ],
        }

    def finish_reason(self, finish: str | None) -> str | None:
        """OpenAI's: "tool_calls" for a list of calls that ended, "stop" for
        a named function's (it is not the model's choice to call)."""
        if finish == "stop" and self.function is None:
            return "tool_calls"
        return finish


def tool_calling(
    tools: list[ToolDefinition] | None,
    choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    template_declares_tools: bool = False,
) -> ToolCalling | None:
    """The request's tool calling, None when it calls none; `ToolError`
    for a choice that cannot be served. `template_declares_tools` says
    whether the chat template renders tool calls (`declares_tools`), which
    only changes what the refusal of "auto" says."""
    if choice is not None and not tools:
        if choice == "none":
            return None
        raise ToolError("tool_choice", "needs tools: send the functions the model may call")
    if not tools or choice == "none":
        return None
    functions = {tool.function.name: tool.function for tool in tools}
    if len(functions) < len(tools):
        raise ToolError("tools", "function names must be unique")
    if choice is None or choice == "auto":
        why = (
            "this model's chat template declares tool calls, but this server does not "
            "parse a model's own tool-call syntax out of free text"
            if template_declares_tools
            else "it needs a model whose chat template declares tool calls, and this one does not"
        )
        raise ToolError(
            "tool_choice",
            f"'auto' (the default with tools) lets the model choose between text and a call: "
            f"{why}; send tool_choice 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
        )
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in functions:
            raise ToolError(
                "tool_choice.function.name",
                f"{name!r} is not among tools ({', '.join(sorted(functions))})",
            )
        return ToolCalling(GrammarSpec.json_schema(_parameters(functions[name])), name)
    one_call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [name]},
                    "parameters": _parameters(function),
                },
                "required": ["name", "parameters"],
            }
            for name, function in functions.items()
        ]
    }
    calls: dict[str, Any] = {"type": "array", "items": one_call, "minItems": 1}
    if parallel_tool_calls is False:
        calls["maxItems"] = 1
    return ToolCalling(GrammarSpec.json_schema(calls))


def declares_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders tool calls (it reads `tools` or
    messages' `tool_calls`)."""
    return chat_template is not None and ("tool_calls" in chat_template or "tools" in chat_template)


def _parameters(function: FunctionDefinition) -> dict[str, Any]:
    return function.parameters if function.parameters is not None else NO_PARAMETERS


def template_tools(tools: list[ToolDefinition] | None) -> list[dict[str, Any]] | None:
    """The tools as plain dicts, as chat templates read them."""
    return None if tools is None else [tool.model_dump(exclude_none=True) for tool in tools]
