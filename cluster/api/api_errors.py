"""OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}`.

Every failure the HTTP server reports goes through `APIError`, so clients
(the official `openai` package included) see the shape and status codes they
expect: 400 for a bad request (validation included, naming the field), 401
without the API key, 404 for an unknown model or route, 413 for a body over
the size limit, 429 (with `Retry-After`) when the server is full, 503 when no
worker can take the request, 500 for a failure inside the cluster. Every
error carries a `code` (never null), which `/metrics` counts refusals by.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",  # as OpenAI reports an unknown model
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}
# The code of an error raised without one of its own.
_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    429: "server_overloaded",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else default_code(status)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def default_code(status: int) -> str:
    """The `code` of an error raised without one."""
    return _CODES.get(status, "invalid_request" if status < 500 else "internal_error")


def error_body(status: int, message: str, param: str | None, code: str) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def validation_error(errors: Sequence[Any]) -> APIError:
    """A 400 naming the first invalid field of a request body."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    # FastAPI prefixes body fields with "body"; OpenAI names the bare field.
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Pydantic puts the union member's type name in the path; drop it.
    loc = [p for p in loc if not p.startswith(("str", "list[", "function-"))] or loc
    param = ".".join(loc) or None
    # A validator's ValueError reads "Value error, <ours>": keep ours.
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({msg})", code="json_invalid")
    if param is None and first.get("type") in ("model_attributes_type", "dict_type"):
        # A body that is not a JSON object, often JSON sent without its content type.
        return APIError(
            400,
            "the request body must be a JSON object, sent with the header "
            "Content-Type: application/json",
            code="invalid_body",
        )
    if first.get("type") == "extra_forbidden":
        msg = "unknown parameter"
    elif first.get("type") == "missing":
        msg = "missing required parameter"
    message = f"{param}: {msg}" if param else msg
    return APIError(400, message, param=param, code=str(first.get("type") or "invalid_value"))


async def handle_api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def handle_validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc.errors()).response()


async def handle_http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    message = str(exc.detail) if status != 404 else "no such route; see /v1/models"
    code = {404: "unknown_route"}.get(status)
    if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's body parse failure
        message = f"the request body is not valid UTF-8 ({exc.__cause__.reason}); send UTF-8 JSON"
        code = "json_invalid"
    return APIError(status, message, code=code).response()
