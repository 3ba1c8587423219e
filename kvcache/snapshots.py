"""Mamba state snapshots: what lets a hybrid model resume a cached prefix.

Attention KV is positional, so a cached block serves any request that shares
its prefix. A Mamba layer's conv and SSM state sums up the whole sequence
instead: a request may skip a cached prefix only where a copy of every Mamba
layer's state at exactly that position exists. The store keeps such copies
(snapshots) in slots of its own, beside the running requests' slots in the
same Mamba buffer, under the hash of the block that ends at their position:

    aligned   [ b0 ][ b1 ][ b2 ]          key = hash(b2), 3 * bs tokens
    tail      [ b0 ][ b1 ][ t t t . ]     key = hash(b1, "t t t"), the hash of
                                          the partial block it ends in

A tail snapshot (the end of a finished sequence, which rarely ends on a block
boundary) also needs the KV of its partial block; the manager publishes that
block under the tail's key, so it is cached and evicted like any full block.

A snapshot is usable only while every block it stands on is cached (its
`chain`): evicting one drops the snapshots past it (`drop_block`). Within its
own budget the store evicts least recently used snapshots first, never a
pinned one (a resume copying it into a request's slot in the step being
built) and never one not yet written (`ready` False until its step ran).

Pure Python over slot ids, like the rest of the bookkeeping; the copies it
implies are described by `StateCopies` and done by the model runner.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from kvcache.errors import IntegrityError

SNAPSHOT_STORED: Final = "snapshot_stored"
SNAPSHOT_REMOVED: Final = "snapshot_removed"
SnapshotEventKind = Literal["snapshot_stored", "snapshot_removed"]
_MAX_PENDING_EVENTS = 65536
# (anchor hash, block index, tail tokens) -> the key of a tail snapshot there.
TailKey = Callable[[bytes, int, tuple[int, ...]], bytes]


@dataclass(frozen=True)
class SnapshotPolicy:
    """Where a hybrid model's Mamba state is snapshotted when reuse is on.

    interval: every `interval` tokens of a sequence (a multiple of the block
        size; 0 for none).
    at_end: the live state of every sequence that ends (finished, preempted or
        handed to a generation worker), at its last computed token.
    on_demand: at the end of a prompt's cached KV when that runs a block or
        more past its last usable snapshot (a shared prefix has shown itself).
    positions: fixed token positions (multiples of the block size).
    num_slots: snapshots kept at once (the store's memory budget in slots).
    """

    interval: int = 0
    at_end: bool = True
    on_demand: bool = True
    positions: tuple[int, ...] = ()
    num_slots: int = 0

    @property
    def takes_any(self) -> bool:
        """Whether the policy ever takes a snapshot."""
        has_point = self.interval > 0 or self.at_end or self.on_demand or bool(self.positions)
        return has_point and self.num_slots > 0

    def validate(self, block_size: int) -> None:
        bad = [p for p in (self.interval, *self.positions) if p < 0 or p % block_size]
        if bad:
            raise ValueError(
                f"snapshot interval and positions must be multiples of the block size "
                f"({block_size}), got {bad}; change kv_cache.snapshots"
            )
        if self.num_slots < 0:
            raise ValueError(f"kv_cache.snapshots.num_slots must be >= 0, got {self.num_slots}")


@dataclass(frozen=True)
class SnapshotEvent:
    """A snapshot became usable, or stopped being usable, on this worker.

    A router matches it like the worker does: an aligned snapshot (`tail`
    0) by its key, the hash of the last full block before it; a tail
    snapshot by the hash of its partial block (`hashing.hash_tail` of the
    prompt's next `tail` tokens onto `anchor`), which is also a cached
    block the worker reported.
    """

    kind: SnapshotEventKind
    key: bytes
    num_tokens: int
    anchor: bytes = b""
    tail: int = 0


@dataclass(eq=False)
class Snapshot:
    key: bytes  # hash of the (full or partial) block ending at num_tokens
    num_tokens: int
    slot: int
    chain: tuple[bytes, ...]  # hashes of every block it stands on, in order
    anchor: bytes = b""  # a tail snapshot's chain before its partial block
    tail: tuple[int, ...] = ()  # tokens of its partial block (empty when aligned)
    ready: bool = False
    pins: int = 0
    orphaned: bool = False  # a block under it left while it was pinned


@dataclass
class StateCopies:
    """Copies one step makes beside its forward, on every rank.

    Before the forward: `block_loads` (source block -> destination block,
    every attention layer) and `slot_loads` (snapshot slot -> a resuming
    request's slot). After it: `slot_saves` (a request's slot -> the
    snapshot slot taking its state at the end of this step's chunk).
    """

    block_loads: list[tuple[int, int]] = field(default_factory=list)
    slot_loads: list[tuple[int, int]] = field(default_factory=list)
    slot_saves: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.block_loads or self.slot_loads or self.slot_saves)


class SnapshotStore:
    """Snapshots in `slots` (ids of the Mamba buffer kept for them).

    Counters: `hits` / `misses` count lookups that did / did not find a
    snapshot past position 0; `evictions` snapshots dropped for room;
    `dropped` snapshots dropped because a block under them was evicted.
    """

    def __init__(self, slots: Iterable[int]) -> None:
        self._free: list[int] = list(slots)
        self.capacity = len(self._free)
        self._by_key: OrderedDict[bytes, Snapshot] = OrderedDict()  # LRU first
        self._tails: dict[bytes, list[Snapshot]] = {}  # anchor hash -> tail snapshots
        self._dependents: dict[bytes, set[bytes]] = {}  # block hash -> snapshot keys
        # Drained by the router's polls; bounded for a worker nobody polls.
        self.events: deque[SnapshotEvent] = deque(maxlen=_MAX_PENDING_EVENTS)
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.dropped = 0

    # -- queries -------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._by_key

    def get(self, key: bytes) -> Snapshot | None:
        return self._by_key.get(key)

    def best(
        self,
        anchors: Sequence[bytes],
        token_ids: Sequence[int],
        block_size: int,
        limit: int,
        tail_key: TailKey,
    ) -> Snapshot | None:
        """The ready snapshot furthest into `token_ids`, at most `limit` tokens in.

        `anchors[j]` is the hash chain after `j` full cached blocks of the
        prompt (`anchors[0]` the root). `tail_key(anchor, j, tail)` gives the
        key a tail snapshot after block `j - 1` must carry (its tokens and
        images hashed onto the anchor). Counts a hit or a miss.
        """
        for j in range(len(anchors) - 1, -1, -1):
            base = j * block_size
            tails = self._tails.get(anchors[j], ())
            for snap in sorted(tails, key=lambda s: -len(s.tail)):
                end = base + len(snap.tail)
                if (
                    not snap.ready
                    or snap.orphaned
                    or end > limit
                    or tuple(token_ids[base:end]) != snap.tail
                ):
                    continue
                if tail_key(anchors[j], j, snap.tail) == snap.key:
                    return self._hit(snap)
            aligned = self._by_key.get(anchors[j]) if j and base <= limit else None
            if aligned is not None and aligned.ready and not aligned.tail and not aligned.orphaned:
                return self._hit(aligned)
        self.misses += 1
        return None

    def _hit(self, snap: Snapshot) -> Snapshot:
        self.hits += 1
        self._by_key.move_to_end(snap.key)
        return snap

    # -- taking --------------------------------------------------------------

    def reserve(self) -> int | None:
        """A slot for a new snapshot: a free one, else the least recently used
        unpinned ready snapshot's; None when every slot is pinned or pending."""
        if self._free:
            return self._free.pop()
        for snap in self._by_key.values():
            if snap.ready and not snap.pins:  # OrderedDict: least recently used first
                self._remove(snap)
                self.evictions += 1
                return self._free.pop()
        return None

    def add(
        self,
        key: bytes,
        num_tokens: int,
        slot: int,
        chain: Sequence[bytes],
        anchor: bytes = b"",
        tail: Sequence[int] = (),
        ready: bool = False,
    ) -> Snapshot:
        """Register a snapshot in `slot` (from `reserve`, or adopted). A tail
        snapshot names the `anchor` its partial block hangs off."""
        if key in self._by_key:
            raise ValueError(f"a snapshot under key {key.hex()[:12]} exists already")
        snap = Snapshot(key, num_tokens, slot, tuple(chain), anchor, tuple(tail), ready)
        self._by_key[key] = snap
        if snap.tail:
            self._tails.setdefault(anchor, []).append(snap)
        for block_hash in snap.chain:
            self._dependents.setdefault(block_hash, set()).add(key)
        if ready:
            self._event(SNAPSHOT_STORED, snap)
        return snap

    def adopt(
        self,
        key: bytes,
        num_tokens: int,
        slot: int,
        chain: Sequence[bytes],
        anchor: bytes = b"",
        tail: Sequence[int] = (),
    ) -> int | None:
        """Take `slot` (a finished request's live state) as a ready snapshot
        and hand back one of the store's slots in its place (for the running
        pool); None, and nothing changes, when the store has none to give."""
        replacement = self.reserve()
        if replacement is None:
            return None
        self.add(key, num_tokens, slot, chain, anchor, tail, ready=True)
        return replacement

    def mark_ready(self, key: bytes) -> None:
        snap = self._by_key.get(key)
        if snap is not None and not snap.ready:
            snap.ready = True
            self._event(SNAPSHOT_STORED, snap)

    def discard(self, key: bytes) -> None:
        """Forget a snapshot that will not be written after all."""
        snap = self._by_key.get(key)
        if snap is not None:
            self._remove(snap)

    def pin(self, snap: Snapshot) -> None:
        snap.pins += 1

    def unpin(self, snap: Snapshot) -> None:
        if snap.pins <= 0:
            raise ValueError(f"unpin of snapshot {snap.key.hex()[:12]} that is not pinned")
        snap.pins -= 1
        if snap.orphaned and not snap.pins:
            self._remove(snap)
            self.dropped += 1

    # -- eviction ------------------------------------------------------------

    def drop_block(self, block_hash: bytes) -> None:
        """A cached block left the cache: snapshots standing on it go. A
        pinned snapshot stays (its resume holds the blocks it reads) and goes
        when unpinned."""
        for key in list(self._dependents.get(block_hash, ())):
            snap = self._by_key[key]
            if snap.pins:
                snap.orphaned = True
                continue
            self._remove(snap)
            self.dropped += 1

    def _remove(self, snap: Snapshot) -> None:
        del self._by_key[snap.key]
        if snap.tail:
            tails = self._tails[snap.anchor]
            tails.remove(snap)
            if not tails:
                del self._tails[snap.anchor]
        for block_hash in snap.chain:
            keys = self._dependents[block_hash]
            keys.discard(snap.key)
            if not keys:
                del self._dependents[block_hash]
        self._free.append(snap.slot)
        if snap.ready:
            self._event(SNAPSHOT_REMOVED, snap)

    def _event(self, kind: SnapshotEventKind, snap: Snapshot) -> None:
        self.events.append(
            SnapshotEvent(kind, snap.key, snap.num_tokens, snap.anchor, len(snap.tail))
        )

    def drain_events(self) -> list[SnapshotEvent]:
        events = []
        while self.events:  # the step thread may append meanwhile
            events.append(self.events.popleft())
        return events

    # -- integrity -----------------------------------------------------------

    def slots(self) -> list[int]:
        """Every slot the store holds, free or in use."""
        return [*self._free, *(snap.slot for snap in self._by_key.values())]

    def check_integrity(self) -> None:
        problems: list[str] = []
        slots = self.slots()
        if len(slots) != self.capacity or len(set(slots)) != len(slots):
            problems.append(f"store holds slots {sorted(slots)} for capacity {self.capacity}")
        for key, snap in self._by_key.items():
            for block_hash in snap.chain:
                if key not in self._dependents.get(block_hash, ()):
                    problems.append(f"snapshot {key.hex()[:12]} is not indexed under its chain")
            if snap.pins < 0:
                problems.append(f"snapshot {key.hex()[:12]} has {snap.pins} pins")
        if problems:
            raise IntegrityError("Mamba snapshot store", problems)
