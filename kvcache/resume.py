"""Prefix reuse for hybrid Mamba models: where requests resume, where
snapshots are taken, and the copies each step makes for both.

The KV cache manager owns one `HybridReuse` when reuse is on for a hybrid
model and calls it at four points of a request's life:

    match_prefix   `plan_resume`: the longest usable snapshot decides how far
                   the request skips; its state is loaded into the request's
                   slot (and a tail snapshot's partial block into a fresh
                   block) before the forward of the next step that runs
    allocate       `plan_save`: a chunk that ends at a snapshot point has its
                   slot copied into a snapshot slot after the forward
    free           `end`: planned copies of a request that never ran are
                   cancelled; with `at_end` its live state becomes a snapshot
                   (its slot changes hands, nothing is copied)
    each step      `take_copies` when the step is built, `step_done` after it
                   ran: pins end, saved snapshots become usable

The scheduler asks `chunk_limit` so that a prefill chunk ends exactly at the
next snapshot point. Pure Python, like the rest of `kvcache`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcache.block import KVBlock
from kvcache.block_pool import BlockPool
from kvcache.mamba_pool import MambaStatePool
from kvcache.snapshots import Snapshot, SnapshotPolicy, SnapshotStore, StateCopies, TailKey


@dataclass
class _Resume:
    snapshot: Snapshot
    slot: int
    tail_block: KVBlock | None  # a tail snapshot's cached partial block, pinned
    fresh_block: int | None  # the request's own block that receives it


@dataclass
class _Save:
    key: bytes
    source: int  # the request's slot
    target: int  # the snapshot's slot


class HybridReuse:
    def __init__(
        self,
        policy: SnapshotPolicy,
        block_size: int,
        pool: BlockPool,
        mamba: MambaStatePool,
        snapshot_slots: Sequence[int],
    ) -> None:
        policy.validate(block_size)
        self.policy = policy
        self.block_size = block_size
        self.store = SnapshotStore(snapshot_slots)
        self._pool = pool
        self._mamba = mamba
        # Planned for the step being built, per request.
        # On-demand snapshot point of a request: (position, key there).
        self._points: dict[str, tuple[int, bytes]] = {}
        self._resumes: dict[str, _Resume] = {}
        self._saves: dict[str, list[_Save]] = {}
        # Taken into the step that runs now.
        self._running_resumes: list[_Resume] = []
        self._running_saves: list[_Save] = []
        self.resumed_tokens = 0

    # -- resume --------------------------------------------------------------

    def best(
        self,
        request_id: str,
        anchors: Sequence[bytes],
        token_ids: Sequence[int],
        tail_key: TailKey,
    ) -> Snapshot | None:
        """The snapshot `token_ids` may resume from (anchors: its cached KV
        chain, root first). Plans an on-demand snapshot where the cached KV
        runs a block or more past it."""
        snap = self.store.best(anchors, token_ids, self.block_size, len(token_ids) - 1, tail_key)
        matched = (len(anchors) - 1) * self.block_size
        resumable = snap.num_tokens if snap is not None else 0
        if self.policy.on_demand and matched >= resumable + self.block_size:
            self._points[request_id] = (matched, anchors[-1])
        else:
            self._points.pop(request_id, None)
        return snap

    def plan_resume(
        self,
        request_id: str,
        snap: Snapshot,
        slot: int,
        tail_block: KVBlock | None,
        fresh: int | None,
    ) -> None:
        """Load `snap` into `slot` (and its partial block into `fresh`) in the
        next step; `tail_block` is already pinned by the caller."""
        self.store.pin(snap)
        self._resumes[request_id] = _Resume(snap, slot, tail_block, fresh)
        self.resumed_tokens += snap.num_tokens

    # -- snapshot points -----------------------------------------------------

    def chunk_limit(self, request_id: str, start: int, num_new: int) -> int:
        """`num_new`, or fewer so that the chunk from `start` ends at the next
        snapshot point."""
        end = start + num_new
        points = [*self.policy.positions, *self._demand(request_id)]
        interval = self.policy.interval
        if interval:
            points.append((start // interval + 1) * interval)
        ahead = [p for p in points if start < p < end]
        return min(ahead) - start if ahead else num_new

    def is_point(self, request_id: str, num_tokens: int) -> bool:
        policy = self.policy
        return (
            (policy.interval > 0 and num_tokens % policy.interval == 0)
            or num_tokens in policy.positions
            or num_tokens in self._demand(request_id)
        )

    def _demand(self, request_id: str) -> tuple[int, ...]:
        """The request's on-demand point, unless a snapshot there is kept or
        planned already (another request sharing the prefix takes it: this
        one's chunks need not stop there)."""
        point = self._points.get(request_id)
        return (point[0],) if point is not None and point[1] not in self.store else ()

    def plan_save(
        self, request_id: str, num_tokens: int, block_hashes: Sequence[bytes], slot: int
    ) -> None:
        """The request's chunk ends at `num_tokens`: keep its state there when
        that is a snapshot point not yet kept."""
        bs = self.block_size
        if num_tokens <= 0 or num_tokens % bs or len(block_hashes) < num_tokens // bs:
            return
        if not self.is_point(request_id, num_tokens):
            return
        chain = block_hashes[: num_tokens // bs]
        key = chain[-1]
        if key in self.store:
            return
        target = self.store.reserve()
        if target is None:
            return
        self.store.add(key, num_tokens, target, chain)
        self._saves.setdefault(request_id, []).append(_Save(key, slot, target))

    # -- the end of a request -------------------------------------------------

    def end(
        self,
        request_id: str,
        computed: int,
        token_ids: Sequence[int] | None,
        block_hashes: Sequence[bytes],
        tail: Callable[[], tuple[bytes, bytes, KVBlock] | None],
    ) -> None:
        """`request_id` leaves with `computed` tokens in its slot: cancel what
        was planned for it and never ran, then, with `at_end`, keep its slot
        as a snapshot of those tokens. `tail()` publishes its partial last
        block and returns (anchor, key, block), None where it cannot."""
        if self.forget(request_id):  # its state never reached the slot
            return
        slot = self._mamba.slot_of(request_id)
        if not self.policy.at_end or slot is None or token_ids is None or computed < 1:
            return
        bs = self.block_size
        num_full = computed // bs
        if len(block_hashes) < num_full:
            return
        chain = list(block_hashes[:num_full])
        anchor = b""
        tail_tokens: tuple[int, ...] = ()
        if computed % bs:
            published = tail()
            if published is None:
                return
            anchor, key, _ = published
            chain.append(key)
            tail_tokens = tuple(token_ids[num_full * bs : computed])
        if chain[-1] in self.store:
            return
        replacement = self.store.adopt(chain[-1], computed, slot, chain, anchor, tail_tokens)
        if replacement is not None:
            self._mamba.exchange(request_id, replacement)

    def forget(self, request_id: str) -> bool:
        """Cancel what was planned for `request_id` and has not run; True
        when that included loading a snapshot into its slot."""
        self._points.pop(request_id, None)
        for save in self._saves.pop(request_id, ()):
            self.store.discard(save.key)
        resume = self._resumes.pop(request_id, None)
        if resume is not None:
            self._unplan(resume)
        return resume is not None

    def _unplan(self, resume: _Resume) -> None:
        self.store.unpin(resume.snapshot)
        self.resumed_tokens -= resume.snapshot.num_tokens
        if resume.tail_block is not None:
            self._pool.release([resume.tail_block])

    # -- steps ---------------------------------------------------------------

    def take_copies(self) -> StateCopies:
        """The copies of the step being built (everything planned so far)."""
        copies = StateCopies()
        for resume in self._resumes.values():
            copies.slot_loads.append((resume.snapshot.slot, resume.slot))
            if resume.tail_block is not None and resume.fresh_block is not None:
                copies.block_loads.append((resume.tail_block.block_id, resume.fresh_block))
        saves = [save for planned in self._saves.values() for save in planned]
        copies.slot_saves.extend((save.source, save.target) for save in saves)
        self._running_resumes = list(self._resumes.values())
        self._running_saves = saves
        self._resumes.clear()
        self._saves.clear()
        return copies

    def step_done(self) -> None:
        """The step taken by `take_copies` ran: its loads are done (their pins
        end) and its saves are written (they become usable)."""
        for resume in self._running_resumes:
            self.store.unpin(resume.snapshot)
            if resume.tail_block is not None:
                self._pool.release([resume.tail_block])
        for save in self._running_saves:
            self.store.mark_ready(save.key)
        self._running_resumes = []
        self._running_saves = []
