"""One physical KV block's bookkeeping record.

A `KVBlock` is a node of the pool's free queue (the `prev_free`/`next_free`
links) and, once full and published, an entry of the prefix cache (`block_hash`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class KVBlock:
    """Bookkeeping for physical block `block_id`.

    ref_cnt: number of request block tables holding this block. A block with
        `ref_cnt == 0` sits in the free queue (free, or cached and evictable).
    block_hash: chained content hash once the block is published for reuse;
        None for blocks that are free, partial, or not published.
    prev_free / next_free: links of the free queue; both None while the block
        is outside the queue.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None
