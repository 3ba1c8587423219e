"""Errors a worker returns to the router for one request."""

from __future__ import annotations


class RequestFailedError(RuntimeError):
    """A request could not be served by this worker; the message says why and
    what to change. The router may retry it elsewhere if nothing was streamed."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id!r} failed: {reason}")
        self.request_id = request_id
        self.reason = reason


class WorkerNotStartedError(RuntimeError):
    """A request reached a worker before `start()` completed."""
