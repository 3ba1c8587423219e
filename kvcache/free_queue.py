"""A doubly linked queue of free blocks, threaded through the blocks themselves.

    head <-> b3 <-> b7 <-> b1 <-> tail        (sentinels at both ends)

`popleft` hands out the least recently freed block, `append` puts a freed one
at the back, and `remove` unlinks a block from the middle in O(1) when a
cached block is revived by a prefix match. A Python deque cannot do the last
one without a scan, which is why the links live on `KVBlock`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvcache.block import KVBlock


class FreeBlockQueue:
    """Order of eviction: front first. Every operation is O(1)."""

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(block_id=-1)
        self._tail = KVBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def popleft(self) -> KVBlock:
        """Remove and return the front block; IndexError when empty."""
        first = self._head.next_free
        if first is None or first is self._tail:
            raise IndexError("pop from an empty free block queue")
        self.remove(first)
        return first

    def append(self, block: KVBlock) -> None:
        """Put `block` at the back (evicted last). It must not be queued already."""
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def remove(self, block: KVBlock) -> None:
        """Unlink `block` from wherever it sits in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def ids(self) -> list[int]:
        """Block ids front to back (for tests and integrity reports)."""
        return [block.block_id for block in self]
