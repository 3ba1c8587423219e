"""Routing policies: which worker of a pool gets the next request.

Pure Python over the router's bookkeeping (`WorkerState`), so every policy is
unit-tested without Ray or torch. A policy never mutates the states it reads;
the router records the dispatch afterwards.

- `round_robin`: the next worker in a fixed cycle.
- `least_loaded`: fewest tokens in flight (prompt + requested output tokens
  of requests dispatched and not finished), then fewest queued requests.
- `prefix_aware`: the worker that can skip the most of the prompt: the
  longest run of its leading block hashes (learned from the workers' KV
  events), or for a hybrid Mamba model only up to the furthest Mamba
  snapshot those blocks reach (learned from its snapshot events), then the one whose
  encoder cache holds the most of the request's images (learned from its
  encoder-cache events; this is what a repeated image+text finds where block
  reuse is off); ties go to the least loaded, and
  remaining ties rotate so equal workers share the load.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.multimodal import EncoderCacheEvent
from kvcache.hashing import ContentSpan, hash_tail

POLICY_NAMES = ("round_robin", "least_loaded", "prefix_aware")


class NoWorkerError(RuntimeError):
    """The pool has no healthy worker left to route to."""


class PromptPrefix(list[bytes]):
    """A prompt's chained full-block hashes (the list itself), with what a
    hybrid worker's tail snapshots are matched against: the prompt's tokens
    and images, the block size and the root hash they were hashed with."""

    def __init__(
        self,
        hashes: Iterable[bytes],
        tokens: Sequence[int],
        block_size: int,
        root: bytes,
        spans: Sequence[ContentSpan] = (),
    ) -> None:
        super().__init__(hashes)
        self.tokens, self.block_size, self.root, self.spans = tokens, block_size, root, spans

    def tail_key(self, anchor: bytes, index: int, length: int) -> bytes:
        start = index * self.block_size
        tail = self.tokens[start : start + length]
        return hash_tail(anchor, index, self.block_size, tail, self.spans)


@dataclass(frozen=True)
class SnapshotRecord:
    anchor: bytes
    tail: int  # tokens past the anchor's block boundary (0: aligned)
    num_tokens: int


@dataclass
class WorkerState:
    """What the router knows about one worker.

    tokens_in_flight: router-side count, raised on dispatch and lowered when
        the request ends, so it is exact between load reports.
    num_queued: the worker's last reported queue length.
    cached_blocks: block hashes the worker reported as stored and not removed.
    snapshots: its Mamba snapshots by key (hybrid models), from its events.
    encoded_images: content hashes of the images the worker's encoder cache
        reported as stored and not evicted.
    healthy: False once a call to the worker failed; such workers get no
        new requests.
    block_size / hybrid: its cache's block size, and whether it serves a
        hybrid Mamba model (a cached prefix then counts up to a snapshot).
    """

    name: str
    tokens_in_flight: int = 0
    num_queued: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    cached_blocks: set[bytes] = field(default_factory=set)
    encoded_images: set[bytes] = field(default_factory=set)
    healthy: bool = True
    block_size: int = 1
    hybrid: bool = False
    snapshots: dict[bytes, SnapshotRecord] = field(default_factory=dict)
    tails: dict[bytes, set[bytes]] = field(default_factory=dict)  # anchor -> tail keys
    # Blocks and snapshots expected from a sequence that just ended here
    # (`expect_sequence`), each with the poll after which it is dropped
    # unless the worker's own events confirm it.
    expected_blocks: dict[bytes, int] = field(default_factory=dict)
    expected_snapshots: dict[bytes, int] = field(default_factory=dict)
    polls: int = 0

    def prefix_match(self, block_hashes: Sequence[bytes]) -> int:
        """Prompt tokens this worker can skip: its leading cached blocks.

        Block hashes chain over their parent, so a hit after a miss cannot be
        reused; counting stops at the first miss. A hybrid worker resumes
        only at a Mamba snapshot: the furthest one those blocks reach (a tail
        snapshot, into the next block, needs the prompt's tokens, which a
        `PromptPrefix` carries), at most one token short of the prompt.
        """
        matched = 0
        for block_hash in block_hashes:
            if block_hash not in self.cached_blocks:
                break
            matched += 1
        if not self.hybrid:
            return matched * self.block_size
        return self._resumable(block_hashes, matched)

    def _resumable(self, block_hashes: Sequence[bytes], matched: int) -> int:
        bs = self.block_size
        prefix = block_hashes if isinstance(block_hashes, PromptPrefix) else None
        limit = len(prefix.tokens) - 1 if prefix is not None else matched * bs
        for j in range(matched, -1, -1):
            if prefix is not None:
                anchor = prefix.root if j == 0 else block_hashes[j - 1]
                best = 0
                for key in self.tails.get(anchor, ()):
                    record = self.snapshots[key]
                    end = j * bs + record.tail
                    fits = best < end <= limit and key in self.cached_blocks
                    if fits and prefix.tail_key(anchor, j, record.tail) == key:
                        best = end
                if best:
                    return best
            if j and j * bs <= limit and block_hashes[j - 1] in self.snapshots:
                return j * bs
        return 0

    def apply_kv_event(self, stored: Sequence[bytes], removed: Sequence[bytes]) -> None:
        self.cached_blocks.difference_update(removed)
        self.cached_blocks.update(stored)
        for block_hash in (*stored, *removed):
            self.expected_blocks.pop(block_hash, None)

    def expect_sequence(self, prefix: PromptPrefix, num_tokens: int) -> None:
        """A sequence ended on this worker with the cache of its first
        `num_tokens` tokens (`prefix`: its tokens, hashed as the worker does).
        Its blocks, and for a hybrid model the snapshot the worker keeps at
        its end, count at once: its next turn may follow before the worker's
        next report. Each expires two reports later unless one confirms it."""
        bs = prefix.block_size
        full = list(prefix[: num_tokens // bs])
        expiry = self.polls + 2
        expected = [h for h in full if h not in self.cached_blocks]
        self.cached_blocks.update(expected)
        if self.hybrid and num_tokens:
            index, tail = num_tokens // bs, num_tokens % bs
            anchor = full[-1] if full else prefix.root
            key = prefix.tail_key(anchor, index, tail) if tail else anchor
            if key not in self.snapshots:
                self.snapshots[key] = SnapshotRecord(anchor, tail, num_tokens)
                if tail:
                    self.tails.setdefault(anchor, set()).add(key)
                    if key not in self.cached_blocks:
                        self.cached_blocks.add(key)
                        expected.append(key)
                self.expected_snapshots[key] = expiry
        for block_hash in expected:
            self.expected_blocks[block_hash] = expiry

    def end_poll(self) -> None:
        """One report applied: expectations no report confirmed in time go."""
        self.polls += 1
        for block_hash in _due(self.expected_blocks, self.polls):
            self.cached_blocks.discard(block_hash)
        for key in _due(self.expected_snapshots, self.polls):
            self._forget_snapshot(key)

    def apply_snapshot_events(self, events: Sequence[Any]) -> None:
        """`kvcache.snapshots.SnapshotEvent`s, oldest first."""
        for event in events:
            self.expected_snapshots.pop(event.key, None)
            if event.kind == "snapshot_stored":
                self.snapshots[event.key] = SnapshotRecord(
                    event.anchor, event.tail, event.num_tokens
                )
                if event.tail:
                    self.tails.setdefault(event.anchor, set()).add(event.key)
                continue
            self._forget_snapshot(event.key)

    def _forget_snapshot(self, key: bytes) -> None:
        record = self.snapshots.pop(key, None)
        if record is not None and record.tail:
            keys = self.tails.get(record.anchor, set())
            keys.discard(key)
            if not keys:
                self.tails.pop(record.anchor, None)

    def image_match(self, image_hashes: Sequence[bytes]) -> int:
        """The request's images whose embeddings this worker has cached."""
        return sum(h in self.encoded_images for h in image_hashes)

    def apply_encoder_events(self, events: Sequence[EncoderCacheEvent]) -> None:
        for event in events:
            if event.stored:
                self.encoded_images.add(event.content_hash)
            else:
                self.encoded_images.discard(event.content_hash)


class RoutingPolicy(Protocol):
    def choose(
        self,
        workers: Sequence[WorkerState],
        block_hashes: Sequence[bytes],
        image_hashes: Sequence[bytes] = (),
    ) -> WorkerState:
        """Pick one healthy worker for a prompt with these block hashes and
        images (content hashes, of the images this worker would encode);
        raises `NoWorkerError` when none is healthy."""
        ...


def _healthy(workers: Sequence[WorkerState]) -> list[WorkerState]:
    healthy = [w for w in workers if w.healthy]
    if not healthy:
        raise NoWorkerError("no healthy worker in the pool; check the worker logs")
    return healthy


def _load_key(worker: WorkerState) -> tuple[int, int]:
    return (worker.tokens_in_flight, worker.num_queued)


class RoundRobinPolicy:
    def __init__(self) -> None:
        self._next = 0

    def choose(
        self,
        workers: Sequence[WorkerState],
        block_hashes: Sequence[bytes],
        image_hashes: Sequence[bytes] = (),
    ) -> WorkerState:
        healthy = _healthy(workers)
        chosen = healthy[self._next % len(healthy)]
        self._next += 1
        return chosen


class _RotatingTieBreak:
    """Among equally good workers, rotate instead of always taking the first."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, tied: list[WorkerState]) -> WorkerState:
        chosen = tied[self._turn % len(tied)]
        self._turn += 1
        return chosen


class LeastLoadedPolicy:
    def __init__(self) -> None:
        self._ties = _RotatingTieBreak()

    def choose(
        self,
        workers: Sequence[WorkerState],
        block_hashes: Sequence[bytes],
        image_hashes: Sequence[bytes] = (),
    ) -> WorkerState:
        healthy = _healthy(workers)
        best = min(_load_key(w) for w in healthy)
        return self._ties.pick([w for w in healthy if _load_key(w) == best])


def _due(expected: dict[bytes, int], polls: int) -> list[bytes]:
    """Take the keys whose expiry has come out of `expected`."""
    due = [key for key, expiry in expected.items() if expiry <= polls]
    for key in due:
        del expected[key]
    return due


class PrefixAwarePolicy:
    def __init__(self) -> None:
        self._ties = _RotatingTieBreak()

    def choose(
        self,
        workers: Sequence[WorkerState],
        block_hashes: Sequence[bytes],
        image_hashes: Sequence[bytes] = (),
    ) -> WorkerState:
        healthy = _healthy(workers)

        def score(worker: WorkerState) -> tuple[int, int, int, int]:
            # Most prompt tokens skipped first, then most images already
            # encoded, then least loaded (hence the negations).
            tokens, queued = _load_key(worker)
            images = worker.image_match(image_hashes)
            return (worker.prefix_match(block_hashes), images, -tokens, -queued)

        best = max(score(w) for w in healthy)
        return self._ties.pick([w for w in healthy if score(w) == best])


def make_policy(name: str) -> RoutingPolicy:
    """A fresh policy instance; each worker pool owns its own."""
    policies: dict[str, type[RoutingPolicy]] = {
        "round_robin": RoundRobinPolicy,
        "least_loaded": LeastLoadedPolicy,
        "prefix_aware": PrefixAwarePolicy,
    }
    if name not in policies:
        raise ValueError(f"unknown router type {name!r}; use one of {', '.join(POLICY_NAMES)}")
    return policies[name]()
