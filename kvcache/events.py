"""KV cache events that let a prefix-aware router track which worker holds what.

A manager with block reuse records one event when it publishes a full block
(`stored`) and one when it evicts a published block (`removed`). The router
drains them periodically (`manager.drain_events()`) and keeps, per worker, the
set of hashes it can serve; hashes are process independent (see `hashing`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Final, Literal

BLOCK_STORED: Final = "stored"
BLOCK_REMOVED: Final = "removed"

KVEventKind = Literal["stored", "removed"]


@dataclass(frozen=True)
class KVEvent:
    """One change to the set of reusable blocks.

    kind: "stored" (block published, now matchable) or "removed" (evicted).
    block_hash: the block's chained content hash.
    parent_hash: hash of the previous block in the chain (the root hash for a
        sequence's first block); None for "removed".
    block_id: the physical block, local to the reporting worker.
    """

    kind: KVEventKind
    block_hash: bytes
    parent_hash: bytes | None
    block_id: int


class KVEventLog:
    """A bounded buffer of pending events.

    When nobody drains it, the oldest events are dropped and counted in
    `num_dropped`, so an idle router cannot grow a worker's memory without bound;
    a router that sees drops should resynchronise rather than trust its view.
    """

    def __init__(self, max_pending: int = 65536) -> None:
        self._events: deque[KVEvent] = deque()
        self._max_pending = max_pending
        self.num_dropped = 0

    def record(self, event: KVEvent) -> None:
        if len(self._events) >= self._max_pending:
            self._events.popleft()
            self.num_dropped += 1
        self._events.append(event)

    def drain(self) -> list[KVEvent]:
        # One popleft at a time: the step thread records while the actor
        # thread drains, and a copy-then-clear would lose what lands between.
        events = []
        while self._events:
            events.append(self._events.popleft())
        return events
