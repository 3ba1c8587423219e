"""Structured-output fields of a request, and the one grammar they ask for.

Accepted, on completions and chat alike:

- OpenAI's `response_format`: `{"type": "text"}`, `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`;
- vLLM's `structured_outputs`: one of `json` (a schema, as an object or its
  text), `json_object: true`, `regex`, `choice` (a list of strings),
  `grammar` (EBNF with a `root` rule);
- the older `guided_json`, `guided_regex`, `guided_choice` and
  `guided_grammar` names vLLM still accepts, and `guided_decoding_backend`
  when it names xgrammar (the only backend here).

A request asks for one constraint at most; `grammar_of` turns it into the
`engine.grammar.GrammarSpec` the workers compile, after checking it
compiles, so a bad schema is a 400 naming the field and what is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.grammar import GrammarError, GrammarSpec, check_grammar

BACKENDS = ("xgrammar", "auto")
# Most choices of one `choice` constraint.
MAX_CHOICES = 256


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    # The output always follows the schema here; strict is accepted as sent.
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object (one constraint of the five)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class StructuredError(ValueError):
    """A constraint the request cannot have; `param` names its field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class StructuredFields(BaseModel):
    """The request fields that constrain the output (mixed into the bodies)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None


def grammar_of(body: StructuredFields) -> tuple[str, GrammarSpec] | None:
    """The request's constraint as `(param, spec)`, `param` naming the field
    it came from; None when unconstrained. Raises `StructuredError` for two
    constraints at once, an empty one, an unknown backend, or a grammar
    that does not compile (the message names the field)."""
    backend = body.guided_decoding_backend
    if backend is not None and backend not in BACKENDS:
        raise StructuredError(
            "guided_decoding_backend",
            f"{backend!r} is not available; structured output here runs on xgrammar "
            "(send 'xgrammar' or leave it out)",
        )
    found = [entry for entry in _constraints(body) if entry is not None]
    if len(found) > 1:
        names = " and ".join(param for param, _ in found)
        raise StructuredError(found[1][0], f"{names} both constrain the output; send one")
    if not found:
        return None
    param, spec = found[0]
    try:
        check_grammar(spec)
    except GrammarError as exc:
        raise StructuredError(param, f"does not compile: {exc}") from None
    return param, spec


def _constraints(body: StructuredFields) -> list[tuple[str, GrammarSpec] | None]:
    out: list[tuple[str, GrammarSpec] | None] = [_response_format(body.response_format)]
    so = body.structured_outputs
    if so is not None:
        given: list[tuple[str, Any, Callable[[str, Any], GrammarSpec]]] = [
            ("structured_outputs.json", so.json_, _schema),
            ("structured_outputs.json_object", so.json_object or None, _any_object),
            ("structured_outputs.regex", so.regex, _regex),
            ("structured_outputs.choice", so.choice, _choice),
            ("structured_outputs.grammar", so.grammar, _ebnf),
        ]
        picked = [(param, make(param, value)) for param, value, make in given if value is not None]
        if not picked:
            raise StructuredError(
                "structured_outputs", "give one of json, json_object, regex, choice, grammar"
            )
        out.extend(picked)
    out.append(_guided("guided_json", body.guided_json, _schema))
    out.append(_guided("guided_regex", body.guided_regex, _regex))
    out.append(_guided("guided_choice", body.guided_choice, _choice))
    out.append(_guided("guided_grammar", body.guided_grammar, _ebnf))
    return out


def _response_format(fmt: ResponseFormat | None) -> tuple[str, GrammarSpec] | None:
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise StructuredError(
                "response_format.json_schema", "only allowed with type json_schema"
            )
        return None
    if fmt.type == "json_object":
        return "response_format", GrammarSpec("json_object")
    if fmt.json_schema is None:
        raise StructuredError("response_format", "type json_schema needs a json_schema object")
    param = "response_format.json_schema.schema"
    return param, _schema(param, fmt.json_schema.schema_)


def _guided(
    param: str, value: Any, make: Callable[[str, Any], GrammarSpec]
) -> tuple[str, GrammarSpec] | None:
    return None if value is None else (param, make(param, value))


def _schema(param: str, schema: dict[str, Any] | str) -> GrammarSpec:
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except ValueError as exc:
            raise StructuredError(param, f"not JSON: {exc}") from None
        if not isinstance(parsed, dict | bool):
            raise StructuredError(param, "a JSON schema is an object")
    return GrammarSpec.json_schema(schema)


def _any_object(param: str, _: bool) -> GrammarSpec:
    return GrammarSpec("json_object")


def _regex(param: str, pattern: str) -> GrammarSpec:
    if not pattern:
        raise StructuredError(param, "the regular expression is empty")
    return GrammarSpec("regex", pattern)


def _ebnf(param: str, grammar: str) -> GrammarSpec:
    if not grammar.strip():
        raise StructuredError(param, "the grammar is empty")
    return GrammarSpec("ebnf", grammar)


def _choice(param: str, choices: list[str]) -> GrammarSpec:
    if not choices or not all(choices):
        raise StructuredError(param, "give a non-empty list of non-empty strings")
    if len(choices) > MAX_CHOICES:
        raise StructuredError(param, f"at most {MAX_CHOICES} choices, got {len(choices)}")
    return GrammarSpec.choices(choices)
