"""The pool of physical KV blocks: allocation, ref counts, the prefix-cache map.

Every usable block is in exactly one of three states:

    free     ref_cnt == 0, no hash      in the free queue
    cached   ref_cnt == 0, hashed       in the free queue and the hash map (evictable)
    in use   ref_cnt  > 0               held by one or more block tables

Block 0 is the permanent null block: block tables are padded with it, so it is
never handed out and never enters the free queue. Allocation takes blocks from
the front of the free queue; a cached block taken there is evicted (its hash
is dropped). Freed blocks go to the back, so the least recently used cached
block is evicted first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvcache.block import KVBlock
from kvcache.errors import IntegrityError
from kvcache.events import BLOCK_REMOVED, BLOCK_STORED, KVEvent, KVEventLog
from kvcache.free_queue import FreeBlockQueue

NULL_BLOCK_ID = 0


class BlockPool:
    """Pure-Python pool of `num_blocks` block ids (including the null block).

    `on_removed` hears the hash of every published block that stops being
    matchable (evicted or withdrawn), e.g. to drop what depended on it.
    """

    def __init__(self, num_blocks: int, on_removed: Callable[[bytes], None] | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"a block pool needs the null block plus at least one usable block, got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(block_id=i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        # The null block is held forever so it never looks free.
        self.null_block.ref_cnt = 1
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[bytes, KVBlock] = {}
        self.events = KVEventLog()
        self.num_evictions = 0
        self.on_removed = on_removed

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus evictable cached."""
        return len(self.free_queue)

    def allocate(self, count: int) -> list[KVBlock]:
        """Take `count` blocks from the front of the free queue, ref_cnt 1 each,
        returned in ascending block id order.

        Which blocks are taken follows the queue (LRU); their order does not:
        tables are released tail-first, so the queue holds freed runs in
        descending order, and handing them out that way would make neighbours
        in a table lie backwards in memory. In ascending order adjacent table
        entries are mostly adjacent in the pool, so a transfer's descriptors
        merge into few large copies and attention reads memory forwards.

        Cached blocks taken this way are evicted. Raises ValueError when fewer
        than `count` blocks are free; callers check `num_free_blocks` first.
        """
        if count > len(self.free_queue):
            raise ValueError(f"cannot allocate {count} blocks, {len(self.free_queue)} free")
        taken = sorted(
            (self.free_queue.popleft() for _ in range(count)), key=lambda block: block.block_id
        )
        for block in taken:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add one reference to each block, reviving cached ones from the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def release(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference from each block in the given order.

        Blocks reaching zero are appended to the free queue in that order;
        managers pass a table tail-first so a chain's head is evicted last.
        """
        for block in blocks:
            if block.ref_cnt <= 0 or block is self.null_block:
                raise ValueError(f"release of block {block.block_id} with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def publish(self, block: KVBlock, block_hash: bytes, parent_hash: bytes) -> bool:
        """Make an in-use full block matchable under `block_hash`.

        Returns False (and leaves the block private) when another block already
        serves this hash: both hold the same content, one copy is enough.
        """
        if block.block_hash is not None:
            raise ValueError(f"block {block.block_id} is already published")
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        self.events.record(KVEvent(BLOCK_STORED, block_hash, parent_hash, block.block_id))
        return True

    def withdraw(self, block: KVBlock) -> None:
        """Unpublish an in-use block whose content will not be computed after
        all (its request left before the step that was to fill it ran)."""
        if block.block_hash is not None:
            self._unpublish(block)

    def _evict(self, block: KVBlock) -> None:
        self._unpublish(block)
        self.num_evictions += 1

    def _unpublish(self, block: KVBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        del self.cached[block_hash]
        self.events.record(KVEvent(BLOCK_REMOVED, block_hash, None, block.block_id))
        block.block_hash = None
        if self.on_removed is not None:
            self.on_removed(block_hash)

    def check_integrity(self) -> None:
        """Raise IntegrityError unless free + cached + in use == usable blocks,
        the queue links are consistent, and the hash map matches the blocks."""
        problems: list[str] = []
        queued = self.free_queue.ids()
        if len(queued) != len(self.free_queue) or len(set(queued)) != len(queued):
            problems.append(f"free queue links inconsistent: {queued} (len {len(self.free_queue)})")
        if NULL_BLOCK_ID in queued or self.null_block.ref_cnt != 1:
            problems.append("null block 0 was handed out or queued")
        queued_set = set(queued)
        free = cached = in_use = 0
        for block in self.blocks[1:]:
            if block.ref_cnt < 0:
                problems.append(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            elif block.ref_cnt == 0:
                if block.block_id not in queued_set:
                    problems.append(f"block {block.block_id} has no owner and is not queued")
                cached += block.is_cached
                free += not block.is_cached
            else:
                in_use += 1
                if block.block_id in queued_set:
                    problems.append(
                        f"block {block.block_id} is queued with ref_cnt {block.ref_cnt}"
                    )
            if block.block_hash is not None and self.cached.get(block.block_hash) is not block:
                problems.append(f"block {block.block_id} carries a hash the map does not point at")
        for block in self.cached.values():
            if self.blocks[block.block_id] is not block or block.block_hash is None:
                problems.append(f"hash map entry for block {block.block_id} is stale")
        if free + cached + in_use != self.num_usable_blocks:
            problems.append(
                f"free {free} + cached {cached} + in use {in_use} != usable {self.num_usable_blocks}"
            )
        if problems:
            raise IntegrityError("block pool", problems)
