"""The KV cache manager API shared by V1 and V2: block tables over a block pool.

A manager maps each request id to a block table (logical block j -> physical
block id) plus, for hybrid models, one Mamba state slot. It is pure Python;
the tensors it indexes are allocated by `kvcache.tensors` from its `layout`.

Request lifecycle as the engine drives it:

    match_prefix(rid, prompt)            # V2 with reuse: take cached blocks
    can_allocate(rid, n) / allocate_slots(rid, n, tokens)   # every step
    free(rid)                            # finished, aborted or preempted

and on the context side, while a prompt's finished blocks may be read by a
puller before its prefill ends (chunk-pipelined transfer):

    hold(rid) ... free(rid) keeps the blocks ... release_hold(rid)

and on the generation side of a disaggregated cluster:

    allocate_for_transfer(rid, n) -> pull the cache -> finish_transfer(rid, tokens)
                                      \\-> free(rid) on abort

and, with reuse on a hybrid model, once per step (`kvcache.resume`):

    chunk_limit(rid, start, n)           # a prefill chunk ends at a snapshot point
    take_copies()                        # the step's state copies, as it is built
    step_done()                          # after it ran

and, for n samples of one prompt (`kvcache.fork`), once its cache is computed:

    fork(parent, child, n)               # share full blocks, copy the rest
    take_copies() / step_done()          # the copies run before the next forward

and, with speculative decoding on a hybrid model (`kvcache.verify_slots`):

    draft_limit(rid, start, k)           # drafts a verify may take here
    take_verify_slots(rid, k)            # scratch slots of its draft positions
    settle_verify(rid, accepted, k)      # after it ran: the accepted state stays

Counters: `prefix_queries` and `prefix_hits` count tokens (prompt tokens asked
about by `match_prefix`, and tokens it covered); `evictions` counts blocks
whose cached content was dropped to make room.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcache.block import KVBlock
from kvcache.block_pool import NULL_BLOCK_ID, BlockPool
from kvcache.errors import IntegrityError, RequestStateError
from kvcache.events import KVEvent
from kvcache.fork import ForkCopies
from kvcache.hashing import ContentSpan, hash_block, hash_tail, root_hash, span_keys
from kvcache.layout import LayoutSignature, RequestRegions
from kvcache.mamba_pool import MambaStatePool
from kvcache.pool_layout import CacheLayout, layout_for
from kvcache.resolution import resolve_block_reuse
from kvcache.resume import HybridReuse
from kvcache.snapshots import SnapshotEvent, SnapshotPolicy, StateCopies
from kvcache.spec import CacheSpec
from kvcache.verify_slots import VerifySlots


@dataclass
class _RequestState:
    blocks: list[KVBlock] = field(default_factory=list)
    num_tokens: int = 0  # tokens the table was last sized for
    block_hashes: list[bytes] = field(default_factory=list)  # of its leading full blocks
    in_transfer: bool = False
    spans: Sequence[ContentSpan] = ()  # its images, hashed into the blocks they overlap
    token_ids: Sequence[int] | None = None  # its tokens as last allocated, with reuse
    # `blocks`' ids, kept beside them: every step reads each running table.
    block_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.block_ids = [block.block_id for block in self.blocks]

    def extend(self, blocks: list[KVBlock]) -> None:
        self.blocks.extend(blocks)
        self.block_ids.extend(block.block_id for block in blocks)


class KVCacheManager:
    """Block tables and Mamba slots of running requests over one block pool.

    num_blocks counts every physical block, the null block 0 included.
    num_mamba_slots is required (> 0) for hybrid specs and ignored otherwise.
    enable_block_reuse is honoured only where `resolve_block_reuse` allows it
    (V2; for a hybrid model only with a `snapshots` policy that takes
    snapshots, whose `num_slots` extra Mamba slots hold them); otherwise it
    is off and a log line says why.
    hash_namespace separates block hashes of different models or dtypes.
    """

    manager_name = "base"

    def __init__(
        self,
        spec: CacheSpec,
        num_blocks: int,
        block_size: int,
        num_mamba_slots: int = 0,
        *,
        enable_block_reuse: bool = False,
        hash_namespace: str = "",
        snapshots: SnapshotPolicy | None = None,
        num_verify_slots: int = 0,
        verify_depth: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if spec.is_hybrid and num_mamba_slots < 1:
            raise ValueError(
                "a hybrid Mamba model needs num_mamba_slots >= 1 (one per running request)"
            )
        self.spec = spec
        self.block_size = block_size
        self._pool = BlockPool(num_blocks, on_removed=self._block_removed)
        self.mamba_pool = MambaStatePool(num_mamba_slots) if spec.is_hybrid else None
        self.enable_block_reuse = resolve_block_reuse(
            enable_block_reuse, self.manager_name, spec.is_hybrid, snapshots
        )
        self.hybrid_reuse: HybridReuse | None = None
        num_snapshot_slots = 0
        if self.enable_block_reuse and self.mamba_pool is not None:
            assert snapshots is not None  # resolve_block_reuse requires it
            num_snapshot_slots = snapshots.num_slots
            self.hybrid_reuse = HybridReuse(
                snapshots,
                block_size,
                self._pool,
                self.mamba_pool,
                range(num_mamba_slots, num_mamba_slots + num_snapshot_slots),
            )
        # Speculative verify steps of a hybrid model: lanes of `verify_depth`
        # scratch slots (`kvcache.verify_slots`, sized by `kvcache.sizing`).
        self.verify: VerifySlots | None = None
        num_slots = num_mamba_slots + num_snapshot_slots
        if num_verify_slots and self.mamba_pool is not None:
            self.verify = VerifySlots(range(num_slots, num_slots + num_verify_slots), verify_depth)
            num_slots += num_verify_slots
        self.layout: CacheLayout = layout_for(
            self.manager_name, spec, block_size, num_blocks, num_slots
        )
        self._root_hash = root_hash(hash_namespace)
        self._requests: dict[str, _RequestState] = {}
        self._forks = ForkCopies(self._pool, self.mamba_pool)
        # Request id -> block lists it lost through `free` while held.
        self._holds: dict[str, list[list[KVBlock]]] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- capacity ------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self._pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to allocations now: free plus evictable cached."""
        return self._pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self._pool.num_free_blocks / self._pool.num_usable_blocks

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def evictions(self) -> int:
        return self._pool.num_evictions

    def free_queue_ids(self) -> list[int]:
        """Free block ids in eviction order (front first)."""
        return self._pool.free_queue.ids()

    # -- allocation ----------------------------------------------------------

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        """Whether `allocate_slots(request_id, num_tokens)` would succeed now."""
        state = self._requests.get(request_id)
        held = len(state.blocks) if state is not None else 0
        if self._blocks_for(num_tokens) - held > self._pool.num_free_blocks:
            return False
        return not self._needs_slot(request_id) or self._mamba().num_free_slots > 0

    def allocate_slots(
        self,
        request_id: str,
        num_tokens: int,
        token_ids: Sequence[int] | None = None,
        spans: Sequence[ContentSpan] = (),
    ) -> bool:
        """Grow the request's table to hold `num_tokens` tokens in total (and give
        a hybrid request its Mamba slot). Returns False and changes nothing when
        blocks or slots are short.

        With reuse on, `token_ids` (the request's tokens so far) publish every
        block they fill within `num_tokens`, each hashed with the `spans`
        (images) overlapping it; the caller computes those blocks' KV in the
        step it allocates them for, before any other step reads them.
        """
        state = self._requests.get(request_id)
        if state is not None and state.in_transfer:
            raise RequestStateError(
                f"request {request_id!r} is receiving its cache; call finish_transfer first"
            )
        if state is not None and self._has_room(state, request_id, num_tokens):
            # Most calls: a decode step inside the request's last block.
            state.num_tokens = max(state.num_tokens, num_tokens)
        elif not self.can_allocate(request_id, num_tokens):
            return False
        else:
            state = self._grow(request_id, num_tokens)
        if token_ids is not None:
            state.spans = spans
            self._publish(state, token_ids)
            state.token_ids = token_ids
            if self.hybrid_reuse is not None:
                slot = self._mamba().slot_of(request_id)
                assert slot is not None
                self.hybrid_reuse.plan_save(request_id, state.num_tokens, state.block_hashes, slot)
        return True

    def chunk_limit(self, request_id: str, start: int, num_new: int) -> int:
        """How many of `num_new` tokens from `start` the request's next chunk
        computes: fewer only so that it ends at a Mamba snapshot point."""
        if self.hybrid_reuse is None or num_new <= 1:
            return num_new
        return self.hybrid_reuse.chunk_limit(request_id, start, num_new)

    def draft_limit(self, request_id: str, start: int, num_drafts: int) -> int:
        """How many of `num_drafts` drafts a verify of the request's token at
        `start` may take: on a hybrid model none without verify slots, and
        with reuse, fewer so that no snapshot point falls inside the verify
        or at its end (only an accepted state may become a snapshot; a plain
        decode that ends at a point saves there)."""
        if self.mamba_pool is None or num_drafts <= 0:
            return max(num_drafts, 0)
        if self.verify is None:
            return 0
        num_drafts = min(num_drafts, self.verify.depth)
        reuse = self.hybrid_reuse
        if reuse is None:
            return num_drafts
        length = reuse.chunk_limit(request_id, start, num_drafts + 1)
        if reuse.is_point(request_id, start + length):
            length -= 1
        return max(length - 1, 0)

    def take_verify_slots(self, request_id: str, num_drafts: int) -> tuple[int, ...] | None:
        """The scratch slots of the request's `num_drafts` draft positions in
        the step being built (hybrid models; () for others); None when none
        are left."""
        if self.mamba_pool is None:
            return ()
        if self.verify is None:
            return None
        return self.verify.take(request_id, num_drafts)

    def settle_verify(
        self,
        request_id: str,
        accepted: int,
        drafted: int,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        """The request's verify ran and kept `accepted` of `drafted` drafts.

        With reuse, `token_ids` (its tokens up to what is computed now, the
        accepted drafts included) publish the blocks those drafts filled."""
        if self.verify is not None:
            self.verify.settle(request_id, accepted, drafted, self._mamba())
        state = self._requests.get(request_id)
        if token_ids is not None and state is not None:
            self._publish(state, token_ids)
            state.token_ids = token_ids

    def cancel_verify(self, request_id: str) -> None:
        """The request's verify in the step being built will not run."""
        if self.verify is not None:
            self.verify.cancel(request_id)

    def take_copies(self) -> StateCopies:
        """The state copies the step being built makes (forks' copies, then
        snapshot loads and saves); call once per step that runs, as it is
        handed to the model."""
        copies = StateCopies() if self.hybrid_reuse is None else self.hybrid_reuse.take_copies()
        return self._forks.take(copies)

    def step_done(self) -> None:
        """The step whose copies `take_copies` returned has run."""
        self._forks.step_done()
        if self.hybrid_reuse is not None:
            self.hybrid_reuse.step_done()
        if self.verify is not None:
            self.verify.step_done()

    def can_fork(self, parent_id: str, num_tokens: int) -> bool:
        """Whether `fork(parent_id, ..., num_tokens)` would succeed now."""
        if parent_id not in self._requests:
            return False
        partial = num_tokens % self.block_size != 0
        if partial and self._pool.num_free_blocks < 1:
            return False
        return self.mamba_pool is None or self.mamba_pool.num_free_slots > 0

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> bool:
        """Give `child_id` the cache of `parent_id`'s first `num_tokens` tokens
        (all computed): their full blocks shared by reference, a fresh block
        for the partly filled last one and, on a hybrid model, a Mamba slot,
        both filled by copies before the next forward (`kvcache.fork`).
        Returns False and changes nothing when a block or slot is short."""
        parent = self._state(parent_id)
        if parent.in_transfer or self._blocks_for(num_tokens) > len(parent.blocks):
            raise RequestStateError(
                f"fork of request {parent_id!r}: its cache does not hold {num_tokens} tokens"
            )
        if child_id in self._requests:
            raise RequestStateError(f"fork into request {child_id!r}, which holds blocks")
        if not self.can_fork(parent_id, num_tokens):
            return False
        num_full = num_tokens // self.block_size
        shared = parent.blocks[:num_full]
        self._pool.touch(shared)
        fresh = self._pool.allocate(1) if num_tokens % self.block_size else []
        child = _RequestState(shared + fresh, num_tokens, parent.block_hashes[:num_full])
        child.spans = parent.spans
        self._requests[child_id] = child
        blocks = (parent.blocks[num_full], fresh[0].block_id) if fresh else None
        slots = None
        if self.mamba_pool is not None:
            source = self.mamba_pool.slot_of(parent_id)
            target = self.mamba_pool.allocate(child_id)
            assert source is not None and target is not None
            slots = (source, target)
        self._forks.add(child_id, blocks, slots)
        return True

    def match_prefix(
        self, request_id: str, token_ids: Sequence[int], spans: Sequence[ContentSpan] = ()
    ) -> int:
        """Take the longest cached chain of full blocks that starts `token_ids`
        (with the same images, `spans`, where they overlap those blocks).

        Returns the number of tokens covered (a multiple of `block_size`, and at
        most `len(token_ids) - 1` so one token is always left to compute). The
        request then holds those blocks until `free`. Returns 0 without reuse.
        The request must hold no blocks yet.
        """
        if not self.enable_block_reuse:
            return 0
        if request_id in self._requests:
            raise RequestStateError(
                f"match_prefix on request {request_id!r}, which already holds blocks"
            )
        self.prefix_queries += len(token_ids)
        hits: list[KVBlock] = []
        hashes: list[bytes] = []
        parent = self._root_hash
        bs = self.block_size
        for index in range(max(len(token_ids) - 1, 0) // bs):
            parent = hash_block(
                parent, token_ids[index * bs : (index + 1) * bs], span_keys(index, bs, spans)
            )
            block = self._pool.lookup(parent)
            if block is None:
                break
            hits.append(block)
            hashes.append(parent)
        if self.hybrid_reuse is not None:
            return self._resume(request_id, token_ids, spans, hits, hashes)
        if not hits:
            return 0
        self._pool.touch(hits)
        num_tokens = len(hits) * bs
        self._requests[request_id] = _RequestState(hits, num_tokens, hashes)
        self.prefix_hits += num_tokens
        return num_tokens

    def free(self, request_id: str, num_computed: int | None = None) -> None:
        """Release the request's blocks (tail first, so a chain's head is evicted
        last) and its Mamba slot. A no-op for unknown request ids.

        `num_computed`: the tokens whose cache was computed, when fewer than
        its table was last sized for (a request preempted before the step it
        was allocated for ran); blocks published past them are withdrawn. With
        reuse on a hybrid model the slot's state at that point may be kept as
        a snapshot (`kvcache.resume`).
        """
        self.cancel_verify(request_id)
        self._forks.cancel(request_id)
        state = self._requests.pop(request_id, None)
        if state is not None:
            computed = state.num_tokens if num_computed is None else num_computed
            if computed < state.num_tokens:
                self._withdraw(state, computed)
            if self.hybrid_reuse is not None:
                self.hybrid_reuse.end(
                    request_id,
                    computed if not state.in_transfer else 0,
                    state.token_ids,
                    state.block_hashes,
                    lambda: self._publish_tail(state, computed),
                )
            held = self._holds.get(request_id)
            if held is not None:
                held.append(state.blocks)
            else:
                self._pool.release(state.blocks[::-1])
        elif self.hybrid_reuse is not None:  # a match that took nothing may have planned
            self.hybrid_reuse.forget(request_id)
        if self.mamba_pool is not None:
            self.mamba_pool.free(request_id)

    def hold(self, request_id: str) -> None:
        """From now on, blocks `request_id` loses through `free` (a preemption,
        an abort, the end of its lease) stay allocated until `release_hold`.

        A context worker holds a prompt whose finished blocks it offered to a
        puller while the prompt still prefills: a preemption then must not
        hand those blocks to another request while a pull may be reading
        them. The Mamba slot is not held (states move only at the end).
        Idempotent.
        """
        self._holds.setdefault(request_id, [])

    def release_hold(self, request_id: str) -> None:
        """Free every block kept for `request_id` since `hold` and end the hold;
        its current table (if any) stays. A no-op for a request not held."""
        for blocks in self._holds.pop(request_id, []):
            self._pool.release(blocks[::-1])

    @property
    def num_held_blocks(self) -> int:
        """Blocks kept by holds after their request freed them."""
        return sum(len(blocks) for held in self._holds.values() for blocks in held)

    # -- transfer-in ---------------------------------------------------------

    def allocate_for_transfer(self, request_id: str, num_tokens: int) -> bool:
        """Blocks (and a slot) to receive `num_tokens` tokens of a new request's
        cache from another worker. Nothing is published until `finish_transfer`.
        Returns False and changes nothing when blocks or slots are short."""
        if request_id in self._requests:
            raise RequestStateError(
                f"request {request_id!r} already holds blocks; cannot transfer in"
            )
        if not self.can_allocate(request_id, num_tokens):
            return False
        self._grow(request_id, num_tokens).in_transfer = True
        return True

    def finish_transfer(
        self,
        request_id: str,
        token_ids: Sequence[int] | None = None,
        spans: Sequence[ContentSpan] = (),
    ) -> None:
        """Mark the transferred cache complete; with reuse on, `token_ids`
        (with the `spans` of its images) publish the full blocks it filled."""
        state = self._requests.get(request_id)
        if state is None or not state.in_transfer:
            raise RequestStateError(f"request {request_id!r} has no transfer in progress")
        state.in_transfer = False
        if token_ids is not None:
            state.spans = spans
            self._publish(state, token_ids)
            state.token_ids = token_ids

    # -- queries -------------------------------------------------------------

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def block_table(self, request_id: str) -> Sequence[int]:
        """The request's block ids in order: the manager's own list, not a copy
        (every step reads every running table), so read-only to the caller and
        current only until the table next changes; copy it to keep it."""
        return self._state(request_id).block_ids

    def mamba_slot(self, request_id: str) -> int | None:
        return self.mamba_pool.slot_of(request_id) if self.mamba_pool is not None else None

    def regions(self, request_id: str) -> RequestRegions:
        """Where the request's KV blocks and Mamba slot sit in the raw buffers."""
        return self.layout.request_regions(
            self.block_table(request_id), self.mamba_slot(request_id)
        )

    def layout_signature(self) -> LayoutSignature:
        return self.layout.signature()

    def drain_events(self) -> list[KVEvent]:
        """Blocks published and evicted since the last call, oldest first."""
        return self._pool.events.drain()

    def drain_snapshot_events(self) -> list[SnapshotEvent]:
        """Mamba snapshots that became usable or stopped being usable since
        the last call, oldest first (none without hybrid reuse)."""
        if self.hybrid_reuse is None:
            return []
        return self.hybrid_reuse.store.drain_events()

    # -- internals -----------------------------------------------------------

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _mamba(self) -> MambaStatePool:
        assert self.mamba_pool is not None
        return self.mamba_pool

    def _needs_slot(self, request_id: str) -> bool:
        return self.mamba_pool is not None and self.mamba_pool.slot_of(request_id) is None

    def _state(self, request_id: str) -> _RequestState:
        state = self._requests.get(request_id)
        if state is None:
            raise RequestStateError(f"unknown request {request_id!r}: it holds no cache")
        return state

    def _has_room(self, state: _RequestState, request_id: str, num_tokens: int) -> bool:
        """Whether the request already has the blocks (and slot) for `num_tokens`."""
        return self._blocks_for(num_tokens) <= len(state.blocks) and not self._needs_slot(
            request_id
        )

    def _grow(self, request_id: str, num_tokens: int) -> _RequestState:
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _RequestState()
        if self._needs_slot(request_id):
            self._mamba().allocate(request_id)
        missing = self._blocks_for(num_tokens) - len(state.blocks)
        if missing > 0:
            state.extend(self._pool.allocate(missing))
        state.num_tokens = max(state.num_tokens, num_tokens)
        return state

    def _resume(
        self,
        request_id: str,
        token_ids: Sequence[int],
        spans: Sequence[ContentSpan],
        hits: list[KVBlock],
        hashes: list[bytes],
    ) -> int:
        """A hybrid prompt skips only up to its longest usable snapshot: take
        the blocks before it and a slot, and plan the snapshot's load."""
        reuse = self.hybrid_reuse
        assert reuse is not None
        bs = self.block_size

        def tail_key(anchor: bytes, index: int, tail: tuple[int, ...]) -> bytes:
            return hash_tail(anchor, index, bs, tail, spans)

        snap = reuse.best(request_id, [self._root_hash, *hashes], token_ids, tail_key)
        if snap is None:
            return 0
        num_full = snap.num_tokens // bs
        blocks = hits[:num_full]
        tail_block = self._pool.lookup(snap.key) if snap.tail else None
        pinned = blocks + ([tail_block] if tail_block is not None else [])
        self._pool.touch(pinned)
        fresh: list[KVBlock] = []
        if snap.tail and (tail_block is None or self._pool.num_free_blocks < 1):
            self._pool.release(pinned[::-1])
            return 0
        if snap.tail:
            fresh = self._pool.allocate(1)
        slot = self._mamba().allocate(request_id)
        if slot is None:
            self._pool.release((pinned + fresh)[::-1])
            return 0
        # The tail block stays pinned until its load ran (`HybridReuse.step_done`).
        state = _RequestState(blocks + fresh, snap.num_tokens, hashes[:num_full])
        state.token_ids, state.spans = token_ids, spans
        self._requests[request_id] = state
        reuse.plan_resume(request_id, snap, slot, tail_block, fresh[0].block_id if fresh else None)
        self.prefix_hits += snap.num_tokens
        return snap.num_tokens

    def _publish_tail(
        self, state: _RequestState, computed: int
    ) -> tuple[bytes, bytes, KVBlock] | None:
        """Publish the partial block holding a leaving request's last
        `computed % block_size` tokens under its tail key: (anchor, key, block)."""
        bs = self.block_size
        index = computed // bs
        if state.token_ids is None or index >= len(state.blocks) or len(state.block_hashes) < index:
            return None
        anchor = state.block_hashes[index - 1] if index else self._root_hash
        tail = list(state.token_ids[index * bs : computed])
        key = hash_tail(anchor, index, bs, tail, state.spans)
        block = state.blocks[index]
        if block.block_hash is None and self._pool.lookup(key) is None:
            self._pool.publish(block, key, anchor)
        return (anchor, key, block) if self._pool.lookup(key) is not None else None

    def _withdraw(self, state: _RequestState, computed: int) -> None:
        """Unpublish the blocks the request published past its computed tokens."""
        first = computed // self.block_size
        for index in range(first, len(state.block_hashes)):
            block = state.blocks[index]
            if block.ref_cnt == 1 and block.block_hash == state.block_hashes[index]:
                self._pool.withdraw(block)
        del state.block_hashes[first:]
        state.num_tokens = computed

    def _block_removed(self, block_hash: bytes) -> None:
        if self.hybrid_reuse is not None:
            self.hybrid_reuse.store.drop_block(block_hash)

    def _publish(self, state: _RequestState, token_ids: Sequence[int]) -> None:
        if not self.enable_block_reuse or state.in_transfer:
            return
        bs = self.block_size
        num_full = min(len(token_ids), state.num_tokens) // bs
        for index in range(len(state.block_hashes), num_full):
            parent = state.block_hashes[-1] if state.block_hashes else self._root_hash
            block_hash = hash_block(
                parent, token_ids[index * bs : (index + 1) * bs], span_keys(index, bs, state.spans)
            )
            state.block_hashes.append(block_hash)
            block = state.blocks[index]
            if block.block_hash is None:
                self._pool.publish(block, block_hash, parent)

    # -- integrity -----------------------------------------------------------

    def _forked_ids(self) -> set[int]:
        """Without reuse, the blocks forks may share: the full blocks of
        tables that start with the same block (a parent and its children),
        and the sources of copies still to run."""
        by_first: dict[int, list[_RequestState]] = {}
        for state in self._requests.values():
            if state.blocks:
                by_first.setdefault(state.block_ids[0], []).append(state)
        ids = {block.block_id for block in self._forks.pinned_blocks()}
        for states in by_first.values():
            if len(states) > 1:
                for state in states:
                    ids.update(state.block_ids[: state.num_tokens // self.block_size])
        return ids

    def check_integrity(self) -> None:
        """Raise IntegrityError unless the pool is consistent and every block's
        ref count equals the number of tables holding it (a held block list
        counts as a table; one table at most
        without reuse), every table is sized for its tokens, and each hybrid
        request owns exactly one Mamba slot."""
        problems: list[str] = []
        for pool in (self._pool, self.mamba_pool):
            try:
                if pool is not None:
                    pool.check_integrity()
            except IntegrityError as error:
                problems.extend(error.problems)
        owners: Counter[int] = Counter()
        for request_id, state in self._requests.items():
            ids = [block.block_id for block in state.blocks]
            owners.update(ids)
            if NULL_BLOCK_ID in ids or len(set(ids)) != len(ids):
                problems.append(f"request {request_id!r} has a bad table {ids}")
            if ids != state.block_ids:
                problems.append(f"request {request_id!r} lists ids {state.block_ids} for {ids}")
            if len(ids) != self._blocks_for(state.num_tokens):
                problems.append(
                    f"request {request_id!r}: {len(ids)} blocks for {state.num_tokens} tokens"
                )
        for held in self._holds.values():
            for blocks in held:
                owners.update(block.block_id for block in blocks)
        owners.update(block.block_id for block in self._forks.pinned_blocks())
        shareable = None if self.enable_block_reuse else self._forked_ids()
        for block in self._pool.blocks[1:]:
            if block.ref_cnt != owners[block.block_id]:
                problems.append(
                    f"block {block.block_id} ref_cnt {block.ref_cnt} but {owners[block.block_id]} tables"
                )
            if (
                owners[block.block_id] > 1
                and shareable is not None
                and (block.block_id not in shareable)
            ):
                problems.append(f"block {block.block_id} owned by {owners[block.block_id]} tables")
        if self.mamba_pool is not None and set(self.mamba_pool.owners()) != set(self._requests):
            problems.append("Mamba slot owners differ from the requests holding blocks")
        if self.mamba_pool is not None:
            slots = [*self.mamba_pool.owners().values(), *self.mamba_pool.free_slots()]
            if self.hybrid_reuse is not None:
                store = self.hybrid_reuse.store
                try:
                    store.check_integrity()
                except IntegrityError as error:
                    problems.extend(error.problems)
                slots += store.slots()
            if self.verify is not None:
                slots += self.verify.slots()
            if sorted(slots) != list(range(self.layout.num_slots)):
                problems.append(
                    "running, snapshot and verify Mamba slots do not cover the buffer once"
                )
        if problems:
            raise IntegrityError(f"{self.manager_name} KV cache manager", problems)
