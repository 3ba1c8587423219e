"""Leases on published caches: the context side's pinning bookkeeping.

A published request stays pinned until exactly one of: the puller releases it,
the holder aborts it, or its lease expires. Whichever comes first calls the
worker's `on_release(request_id)` once (so blocks and slots are freed once);
later releases are no-ops. While bytes of a request are being streamed out,
expiry is deferred to the end of the stream so freed blocks are never sent.

Expiry runs on event-loop timers, that is on this process's monotonic clock:
the holder alone decides when a lease has run out (no wall-clock stamp
crosses to another node, whose clock may differ). The table itself is plain
Python.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class Lease:
    """One published request. `payload` is what the transceiver needs to serve it."""

    request_id: str
    transfer_id: str
    on_release: Callable[[str], None]
    payload: Any = None
    streams: int = 0  # transfers currently reading this request's bytes
    expired: bool = False  # lease ran out while streaming; release when streams end
    pulled_by: set[int] = field(default_factory=set)  # puller ranks done (tensor parallel)
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class LeaseTable:
    """Pinned requests by id, each with an expiry timer on the running loop."""

    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}
        self.num_expired = 0  # leases that ran out unpulled (a health signal)

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    def add(
        self,
        request_id: str,
        transfer_id: str,
        lease_s: float,
        on_release: Callable[[str], None],
        payload: Any = None,
    ) -> Lease:
        """Pin `request_id` for `lease_s` seconds. Must run on the event loop."""
        if request_id in self._leases:
            raise ValueError(f"request {request_id!r} is already published; release it first")
        if lease_s <= 0:
            raise ValueError(f"cache_transceiver.lease_s must be positive, got {lease_s}")
        lease = Lease(request_id, transfer_id, on_release, payload)
        lease.timer = asyncio.get_running_loop().call_later(lease_s, self._expire, request_id)
        self._leases[request_id] = lease
        return lease

    @property
    def num_unclaimed(self) -> int:
        """Live leases no transfer is reading: a puller's claim or pull is still due."""
        return sum(1 for lease in self._leases.values() if lease.streams == 0)

    def get(self, request_id: str, transfer_id: str | None = None) -> Lease | None:
        """The live lease of `request_id` (and `transfer_id`, when given), else None."""
        lease = self._leases.get(request_id)
        if lease is None or lease.expired:
            return None
        if transfer_id is not None and lease.transfer_id != transfer_id:
            return None
        return lease

    def release(self, request_id: str, transfer_id: str | None = None) -> bool:
        """Unpin and call `on_release`; idempotent. True if this call released it."""
        lease = self._leases.get(request_id)
        if lease is None or (transfer_id is not None and lease.transfer_id != transfer_id):
            return False
        del self._leases[request_id]
        if lease.timer is not None:
            lease.timer.cancel()
        try:
            lease.on_release(request_id)
        except Exception:  # the worker's callback must not break the transport
            logger.exception("on_release of request %r failed", request_id)
        return True

    def release_by(
        self, request_id: str, transfer_id: str, puller_rank: int, num_pullers: int
    ) -> bool:
        """Puller rank `puller_rank` of `num_pullers` is done with the request:
        the last of them releases it (each rank of a tensor-parallel puller
        reads its own heads from every holder). True if this call released it."""
        lease = self._leases.get(request_id)
        if lease is None or lease.transfer_id != transfer_id:
            return False
        lease.pulled_by.add(puller_rank)
        if len(lease.pulled_by) < num_pullers:
            return False
        return self.release(request_id, transfer_id)

    def begin_stream(self, lease: Lease) -> None:
        lease.streams += 1

    def end_stream(self, lease: Lease) -> None:
        """A stream ended; an expiry that arrived meanwhile takes effect now."""
        lease.streams -= 1
        if lease.expired and lease.streams == 0:
            self.release(lease.request_id, lease.transfer_id)

    def release_all(self) -> None:
        for request_id in list(self._leases):
            self.release(request_id)

    def _expire(self, request_id: str) -> None:
        lease = self._leases.get(request_id)
        if lease is None:
            return
        self.num_expired += 1
        logger.warning(
            "lease of request %r expired before it was pulled; freeing its cache "
            "(raise cache_transceiver.lease_s if generation workers are slow to pull)",
            request_id,
        )
        lease.expired = True
        if lease.streams == 0:
            self.release(request_id)
