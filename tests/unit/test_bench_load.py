"""`disagg bench` against a server that needs an API key (an in-memory
OpenAI-shaped endpoint): the key from `--api-key` or `$OPENAI_API_KEY`, what
a 401 says, and `--help` showing every default."""

from __future__ import annotations

import argparse
import functools
import json

import httpx
import pytest

from cluster.bench import load
from cluster.cli import main

KEY = "sk-local-test"
BASE = "http://bench.test:8000/v1"
OPENAI_API_KEY = "OPENAI_API_KEY"  # what the openai client reads
REFUSED = {"error": {"message": "Incorrect API key provided", "code": "invalid_api_key"}}


class KeyedServer:
    """/v1/models and streaming /v1/completions behind a bearer key; keeps
    every Authorization header it was sent."""

    def __init__(self) -> None:
        self.authorizations: list[str | None] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.authorizations.append(request.headers.get("authorization"))
        if request.headers.get("authorization") != f"Bearer {KEY}":
            return httpx.Response(401, json=REFUSED)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]})
        chunks = [{"choices": [{"index": 0, "text": t}]} for t in ("a", "b", "c")]
        chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> KeyedServer:
    served = KeyedServer()
    transport = httpx.MockTransport(served.handle)
    monkeypatch.setattr(
        load.httpx, "AsyncClient", functools.partial(httpx.AsyncClient, transport=transport)
    )
    # No /metrics to read: the endpoint is in memory.
    monkeypatch.setattr(load, "read_spec_totals", lambda root: None)
    monkeypatch.setattr(load, "read_settled", lambda root: None)
    monkeypatch.delenv(OPENAI_API_KEY, raising=False)
    return served


def _bench(*extra: str) -> int:
    argv = ["bench", "--base-url", BASE, "--num-prompts", "2", "--input-len", "4"]
    return main([*argv, "--output-len", "3", "--no-progress", *extra])


def test_the_key_given_with_api_key_is_sent(
    server: KeyedServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _bench("--api-key", KEY) == 0
    assert "2/2 ok" in capsys.readouterr().out
    assert set(server.authorizations) == {f"Bearer {KEY}"}


def test_the_key_defaults_to_openai_api_key(
    server: KeyedServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(OPENAI_API_KEY, KEY)
    assert _bench() == 0
    assert "2/2 ok" in capsys.readouterr().out
    assert set(server.authorizations) == {f"Bearer {KEY}"}


def test_a_refused_key_is_reported_as_refused_not_unreachable(
    server: KeyedServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _bench("--api-key", "not-the-key") == 1
    err = capsys.readouterr().err
    assert "refused the API key" in err
    assert "Incorrect API key provided" in err  # the server's own words
    assert "--api-key" in err and OPENAI_API_KEY in err
    assert "cannot reach" not in err


def test_a_missing_key_says_none_was_sent(
    server: KeyedServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _bench() == 1
    err = capsys.readouterr().err
    assert "needs an API key and none was sent" in err
    assert "cannot reach" not in err


def test_with_model_given_every_refused_request_says_so(
    server: KeyedServer, capsys: pytest.CaptureFixture[str]
) -> None:
    # --model skips /v1/models: the refusals come from the requests themselves.
    assert _bench("--model", "m", "--api-key", "wrong") == 1
    out = capsys.readouterr().out
    assert "0/2 ok" in out
    assert "refused the API key" in out


def test_help_shows_every_default() -> None:
    parser = argparse.ArgumentParser(prog="disagg bench")
    load.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if not action.option_strings or action.nargs == 0:
            continue  # positional, or a flag (store_true: off unless given)
        if action.default is None:
            assert "(default:" in (action.help or ""), f"{action.dest}: say what happens without it"
        else:
            shown = f"(default: {action.default}"
            assert shown in text, f"{action.option_strings[0]}'s default is not in --help"


def test_the_server_root_or_the_api_root_is_accepted() -> None:
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert load.api_base(url) == "http://h:8000/v1"
