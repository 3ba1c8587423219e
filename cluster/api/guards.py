"""Checks every HTTP request passes before a route sees it: API key and body size.

`RequestGuard` is a plain ASGI middleware, so it runs before FastAPI reads or
parses the body:

    client ──► RequestGuard ──► FastAPI routes
               │ 401  no / wrong `Authorization: Bearer <key>` (API routes only)
               │ 413  body over `max_body_bytes` (Content-Length, or counted
               │      while it streams in for chunked uploads)

Refusals carry OpenAI's error JSON. `/health` and `/metrics` stay open
without a key, so load balancers and Prometheus need no secret; everything
else (the `/v1` API) needs it when a key is set.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

from cluster.api.api_errors import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/metrics"})
DEFAULT_MAX_BODY_BYTES = 1 << 20


class BodyTooLargeError(HTTPException):
    """A streamed body passed the limit after its headers were accepted.

    An `HTTPException`, so FastAPI, which reads the body inside the route,
    passes it to the server's error handler as a 413 instead of a parse error.
    """

    def __init__(self, limit: int) -> None:
        super().__init__(413, too_large_message(limit + 1, limit))


class RequestGuard:
    """ASGI middleware: 401 without the API key (when one is set), 413 past the body limit.

    api_key: the bearer token clients must send; None or "" disables the check.
    max_body_bytes: largest request body accepted, in bytes.
    """

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body_bytes: int,
        on_refused: Callable[[int, str], None] | None = None,
    ) -> None:
        if max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
        self.app = app
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes
        # Hears (status, code) of every request this guard refuses.
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        if not self._authorized(scope, headers):
            await self._refuse(send, 401, _unauthorized_message(headers), "invalid_api_key")
            return
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            message = too_large_message(int(declared), self.max_body_bytes)
            await self._refuse(send, 413, message, "request_too_large")
            return
        await self.app(scope, _CountingReceive(receive, self.max_body_bytes), send)

    async def _refuse(self, send: Send, status: int, message: str, code: str) -> None:
        if self.on_refused is not None:
            self.on_refused(status, code)
        await _refuse(send, status, message, code)

    def _authorized(self, scope: Scope, headers: dict[str, str]) -> bool:
        if self.api_key is None or scope.get("path") in OPEN_PATHS:
            return True
        scheme, _, token = headers.get("authorization", "").partition(" ")
        # Constant-time comparison: response timing must not reveal the key's prefix.
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip(), self.api_key)


def too_large_message(size: int, limit: int) -> str:
    return (
        f"the request body has {size} bytes or more; this server accepts at most "
        f"{limit} (max_request_body_bytes in the config)"
    )


class _CountingReceive:
    """Passes body chunks through, raising once more than `limit` bytes arrived."""

    def __init__(self, receive: Receive, limit: int) -> None:
        self.receive = receive
        self.limit = limit
        self.received = 0

    async def __call__(self) -> Message:
        message = await self.receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                raise BodyTooLargeError(self.limit)
        return message


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def _unauthorized_message(headers: dict[str, str]) -> str:
    if "authorization" not in headers:
        return "missing API key; send the header 'Authorization: Bearer <key>'"
    return "invalid API key; send the server's key as 'Authorization: Bearer <key>'"


async def _refuse(send: Send, status: int, message: str, code: str) -> None:
    payload = json.dumps(error_body(status, message, None, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
