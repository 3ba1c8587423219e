"""Admission control: a bound on the requests the cluster holds at once.

Every completion takes one slot from arrival until its last byte is sent (or
the client leaves). With all slots taken a new request is refused at once
with 429 and a `Retry-After` hint instead of waiting in an unbounded queue,
so memory stays flat under any offered load and the workers' own waiting
queues never hold more than `max_requests` requests between them.

Pure bookkeeping over ints on the server's event loop (no locks needed).
"""

from __future__ import annotations

import math

from cluster.api.api_errors import APIError

DEFAULT_MAX_QUEUED_REQUESTS = 256


class Admission:
    """At most `max_requests` requests in flight; `acquire` / `release` pair up.

    retry_after_s: the `Retry-After` value (whole seconds, at least 1) sent
    with a refusal.
    """

    def __init__(self, max_requests: int, retry_after_s: float = 1.0) -> None:
        if max_requests <= 0:
            raise ValueError(f"max_requests must be positive, got {max_requests}")
        self.max_requests = max_requests
        self.retry_after_s = max(1, math.ceil(retry_after_s))
        self.in_flight = 0
        self.num_rejected = 0

    def acquire(self) -> None:
        """Take a slot; raises a 429 `APIError` (with `Retry-After`) when none is free."""
        if self.in_flight >= self.max_requests:
            self.num_rejected += 1
            raise APIError(
                429,
                f"the server is at its limit of {self.max_requests} requests in flight "
                f"(router.max_queued_requests); retry after {self.retry_after_s}s",
                code="server_overloaded",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self.in_flight += 1

    def release(self) -> None:
        """Give back a slot taken by `acquire`."""
        if self.in_flight <= 0:
            raise RuntimeError("Admission.release without a matching acquire")
        self.in_flight -= 1
