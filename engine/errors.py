"""Errors a worker returns to the router for one request."""

from __future__ import annotations


class RequestFailedError(RuntimeError):
    """A request could not be served by this worker; the message says why and
    what to change. The router may retry it elsewhere if nothing was streamed."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(reason if request_id in reason else f"request {request_id!r}: {reason}")
        self.request_id = request_id
        self.reason = reason

    def __reduce__(self) -> tuple[type[RequestFailedError], tuple[str, str]]:
        # Ray pickles exceptions across actors; rebuild from the two fields.
        return (type(self), (self.request_id, self.reason))


class WorkerNotStartedError(RuntimeError):
    """A request reached a worker before `start()` completed."""
