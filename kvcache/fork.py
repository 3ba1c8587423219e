"""Forked sequences: n samples of one prompt share its cache.

`KVCacheManager.fork(parent, child, num_tokens)` gives the child the
parent's full blocks by reference (one more `ref_cnt` each, as prefix reuse
does) and, for what differs, copies:

    parent table   [ b3 | b7 | b9* ]        b9* holds tokens 32..37 of 38
    child table    [ b3 | b7 | b12 ]        b12 <- copy of b9 (block_loads)
    Mamba          slot 2 -> slot 5         (slot_loads, hybrid models)

The partly filled last block is copied, not recomputed: a hybrid model's
Mamba state exists only at the prompt's end, so a child recomputing the
block's tokens would need the state at the block's start, which no one
kept; one block copy per layer is what a Mamba slot copy costs anyway.

The copies run on the device before the forward of the next step that runs
(`StateCopies`, applied by the runner), ahead of that step's snapshot loads.
Until then their sources are pinned: the source block holds one more
reference and the source slot is parked if its request frees it, so a pull
allocated beside the step cannot take either and write into it first. A
child freed before its copies were taken drops them (its fresh block may
have a new owner by then).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.block import KVBlock
from kvcache.block_pool import BlockPool
from kvcache.mamba_pool import MambaStatePool
from kvcache.snapshots import StateCopies


@dataclass
class _ForkCopy:
    child_id: str
    source_block: KVBlock | None = None
    target_block: int | None = None
    source_slot: int | None = None
    target_slot: int | None = None


@dataclass
class ForkCopies:
    """The forks' copies not yet run, and the sources they pin."""

    pool: BlockPool
    mamba_pool: MambaStatePool | None
    _pending: list[_ForkCopy] = field(default_factory=list)
    _taken: list[_ForkCopy] = field(default_factory=list)

    def add(
        self,
        child_id: str,
        blocks: tuple[KVBlock, int] | None,
        slots: tuple[int, int] | None,
    ) -> None:
        """Copy `blocks` (source block, target id) and `slots` (source,
        target) for `child_id` before the next forward; pin the sources."""
        copy = _ForkCopy(child_id)
        if blocks is not None:
            copy.source_block, copy.target_block = blocks
            self.pool.touch([copy.source_block])
        if slots is not None:
            assert self.mamba_pool is not None
            copy.source_slot, copy.target_slot = slots
            self.mamba_pool.pin(copy.source_slot)
        self._pending.append(copy)

    def cancel(self, child_id: str) -> None:
        """`child_id` leaves before its copies were taken: drop them."""
        keep = []
        for copy in self._pending:
            if copy.child_id == child_id:
                self._unpin(copy)
            else:
                keep.append(copy)
        self._pending = keep

    def take(self, into: StateCopies) -> StateCopies:
        """`into` with the pending copies put first (they read a parent's
        block or slot before anything else writes there)."""
        if not self._pending:
            return into
        blocks = [
            (c.source_block.block_id, c.target_block)
            for c in self._pending
            if c.source_block is not None and c.target_block is not None
        ]
        slots = [
            (c.source_slot, c.target_slot)
            for c in self._pending
            if c.source_slot is not None and c.target_slot is not None
        ]
        self._taken.extend(self._pending)
        self._pending = []
        return StateCopies(
            block_loads=[*blocks, *into.block_loads],
            slot_loads=[*slots, *into.slot_loads],
            slot_saves=into.slot_saves,
        )

    def step_done(self) -> None:
        """The step that took the copies ran: unpin their sources."""
        for copy in self._taken:
            self._unpin(copy)
        self._taken = []

    def pinned_blocks(self) -> list[KVBlock]:
        """Source blocks holding a reference for a copy (for `check_integrity`)."""
        return [c.source_block for c in (*self._pending, *self._taken) if c.source_block]

    def _unpin(self, copy: _ForkCopy) -> None:
        if copy.source_block is not None:
            self.pool.release([copy.source_block])
        if copy.source_slot is not None:
            assert self.mamba_pool is not None
            self.mamba_pool.unpin(copy.source_slot)
