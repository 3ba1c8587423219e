"""The HTTP edge guards: API key, body size limit, admission (429), CLI key sources."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.api.admission import Admission
from cluster.api.api_errors import (
    APIError,
    handle_api_error,
    handle_http_error,
    handle_validation_error,
)
from cluster.api.guards import RequestGuard
from cluster.api.protocol import CompletionRequest
from cluster.serve import API_KEY_ENV, add_arguments, build_config

KEY = "sk-test-0123456789"
LIMIT = 4096


def _app(api_key: str | None, admission: Admission | None = None) -> FastAPI:
    """An app with the server's error handlers, guard and one completion route."""
    app = FastAPI()
    app.add_exception_handler(APIError, handle_api_error)
    app.add_exception_handler(RequestValidationError, handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, handle_http_error)
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=LIMIT)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> dict[str, str]:
        if admission is not None:
            admission.acquire()
        return {"ok": body.model}

    return app


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(_app(KEY)) as test_client:
        yield test_client


BODY = {"model": "m", "prompt": "hello"}


def _assert_openai_error(response: object, status: int, code: str) -> dict[str, object]:
    assert getattr(response, "status_code") == status  # noqa: B009
    error = getattr(response, "json")()["error"]  # noqa: B009
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    return dict(error)


def test_missing_or_wrong_key_is_a_401_and_the_right_key_passes(client: TestClient) -> None:
    error = _assert_openai_error(client.post("/v1/completions", json=BODY), 401, "invalid_api_key")
    assert "Authorization: Bearer" in str(error["message"])
    assert error["type"] == "invalid_request_error"
    wrong = client.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer nope"})
    _assert_openai_error(wrong, 401, "invalid_api_key")
    assert wrong.headers["www-authenticate"] == "Bearer"
    basic = client.post("/v1/completions", json=BODY, headers={"Authorization": f"Basic {KEY}"})
    _assert_openai_error(basic, 401, "invalid_api_key")
    ok = client.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json() == {"ok": "m"}


def test_health_stays_open_and_unknown_routes_need_the_key(client: TestClient) -> None:
    assert client.get("/health").status_code == 200
    _assert_openai_error(client.get("/v1/nothing"), 401, "invalid_api_key")


def test_no_key_configured_leaves_the_api_open() -> None:
    with TestClient(_app(None)) as open_client:
        assert open_client.post("/v1/completions", json=BODY).status_code == 200


def test_body_over_the_limit_is_a_413_declared_or_streamed(client: TestClient) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    big = {"model": "m", "prompt": "x" * (LIMIT + 10)}
    error = _assert_openai_error(
        client.post("/v1/completions", json=big, headers=auth), 413, "request_too_large"
    )
    assert str(LIMIT) in str(error["message"])

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"model": "m", "prompt": "'
        for _ in range(LIMIT // 512 + 1):
            yield b"x" * 512
        yield b'"}'

    streamed = client.post("/v1/completions", content=chunks(), headers=auth)
    _assert_openai_error(streamed, 413, "request_too_large")
    assert client.post("/v1/completions", json=BODY, headers=auth).status_code == 200


def test_invalid_utf8_body_is_a_400(client: TestClient) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    body = b'{"model": "m", "prompt": "\xff\xfe bad"}'
    response = client.post("/v1/completions", content=body, headers=headers)
    assert response.status_code == 400
    error = _assert_openai_error(response, 400, "json_invalid")
    assert "UTF-8" in str(error["message"])


def test_admission_refuses_with_429_and_retry_after_until_a_slot_frees() -> None:
    admission = Admission(max_requests=2, retry_after_s=0.3)
    admission.acquire()
    admission.acquire()
    with pytest.raises(APIError) as info:
        admission.acquire()
    assert info.value.status == 429
    assert info.value.headers == {"Retry-After": "1"}
    assert info.value.body()["error"]["code"] == "server_overloaded"
    assert admission.num_rejected == 1
    admission.release()
    admission.acquire()
    assert admission.in_flight == 2
    with pytest.raises(ValueError, match="positive"):
        Admission(0)


def test_a_429_reaches_the_client_with_retry_after() -> None:
    admission = Admission(max_requests=1)
    with TestClient(_app(None, admission)) as test_client:
        assert test_client.post("/v1/completions", json=BODY).status_code == 200
        refused = test_client.post("/v1/completions", json=BODY)
    error = _assert_openai_error(refused, 429, "server_overloaded")
    assert error["type"] == "rate_limit_error"
    assert refused.headers["retry-after"] == "1"


def test_api_key_comes_from_the_flag_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def parse(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return parser.parse_args(["--model", "ckpt", *argv])

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert build_config(parse()).api_key is None
    assert build_config(parse("--api-key", "abc")).api_key == "abc"
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert build_config(parse()).api_key == "from-env"
    assert build_config(parse("--api-key", "flag-wins")).api_key == "flag-wins"


def test_the_guard_reports_each_refusal_by_status_and_code() -> None:
    refused: list[tuple[int, str]] = []
    app = FastAPI()
    app.add_middleware(
        RequestGuard,
        api_key=KEY,
        max_body_bytes=LIMIT,
        on_refused=lambda s, c: refused.append((s, c)),
    )

    @app.post("/v1/completions")
    async def completions() -> dict[str, str]:
        return {"ok": "yes"}

    client = TestClient(app)
    client.post("/v1/completions", json=BODY)
    big = {"Authorization": f"Bearer {KEY}", "content-length": str(LIMIT + 1)}
    client.post("/v1/completions", content=b"x" * (LIMIT + 1), headers=big)
    passed = client.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {KEY}"})
    assert passed.status_code == 200
    assert refused == [(401, "invalid_api_key"), (413, "request_too_large")]
