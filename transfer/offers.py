"""Offers: finished blocks of a prompt that is still prefilling, readable early.

With chunk-pipelined transfer a context worker lets the generation side pull
the blocks of each finished prefill chunk while it computes the next ones.
An offer is the holder's record of what it has made readable so far for one
request; it is not a lease (nothing is pinned by it: the worker keeps the
blocks with `KVCacheManager.hold`) and it has no expiry (it lives while the
prompt prefills):

    offer(rid, blocks [0, 4))  -> handle, transfer id T   (a partial pull reads them)
    offer(rid, blocks [4, 8))  -> handle, transfer id T
    publish(rid, all blocks + Mamba slot)   -> the lease takes over T
    or withdraw(rid, on_quiet)              -> on_quiet() once no read is in flight

`on_quiet` is where the worker may give held blocks back: a read that was
already under way (a Python stream being sent, a NIXL READ inside its claim
window) has ended by then.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from transfer.plan import Coverage
from transfer.region_arrays import RegionArrays

logger = logging.getLogger(__name__)


@dataclass
class Offer:
    request_id: str
    transfer_id: str
    parts: list[RegionArrays] = field(default_factory=list)  # each offer's segments
    coverage: Coverage = field(default_factory=lambda: Coverage(()))
    readers: int = 0  # reads in flight: Python streams, NIXL claim windows
    on_quiet: Callable[[], None] | None = None  # set once withdrawn

    def extend(self, segments: RegionArrays) -> None:
        self.parts.append(segments)
        self.coverage = Coverage(RegionArrays.concat(self.parts))

    def begin_read(self) -> None:
        self.readers += 1

    def end_read(self) -> None:
        self.readers -= 1
        self._quiet_if_done()

    def withdraw(self, on_quiet: Callable[[], None]) -> None:
        self.on_quiet = on_quiet
        self._quiet_if_done()

    def _quiet_if_done(self) -> None:
        if self.on_quiet is None or self.readers > 0:
            return
        on_quiet, self.on_quiet = self.on_quiet, None
        try:
            on_quiet()
        except Exception:  # the worker's callback must not break the transport
            logger.exception("on_quiet of request %r failed", self.request_id)
