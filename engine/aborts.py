"""Remembered aborts: an abort that arrives before its request.

Ray does not order calls to an async actor, so a router's `abort(id)` (the
client went away) can run before the `prefill` / `generate` call it was
meant to cancel. A worker records such ids for a while and refuses the late
call, instead of running a request nobody reads and pinning its cache.
"""

from __future__ import annotations

import time
from collections import OrderedDict

# Longer than a request spends between the router's dispatch and the worker.
DEFAULT_TTL_S = 120.0
_MAX_IDS = 65536  # bounds memory if aborts arrive for ids that never come


class AbortedIds:
    """Request ids aborted before they were seen; each is forgotten after
    `ttl_s` seconds or when consumed by `take`."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_ids: int = _MAX_IDS) -> None:
        self._ttl_s = ttl_s
        self._max_ids = max_ids
        self._ids: OrderedDict[str, float] = OrderedDict()

    def add(self, request_id: str) -> None:
        self._expire()
        self._ids[request_id] = time.monotonic() + self._ttl_s
        self._ids.move_to_end(request_id)
        while len(self._ids) > self._max_ids:
            self._ids.popitem(last=False)

    def take(self, request_id: str) -> bool:
        """True (once) if `request_id` was aborted before it arrived."""
        self._expire()
        return self._ids.pop(request_id, None) is not None

    def __contains__(self, request_id: object) -> bool:
        """Whether `request_id` was aborted before it arrived (not consumed)."""
        self._expire()
        return request_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._ids:
            request_id, deadline = next(iter(self._ids.items()))
            if deadline > now:
                return
            del self._ids[request_id]
