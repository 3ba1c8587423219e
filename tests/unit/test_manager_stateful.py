"""Property test: random allocate / append / free / match / evict / transfer
sequences never leak a block or slot, never double-own one, and never hand out
a cached block whose content differs from the prompt it matched."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache.factory import create_manager
from kvcache.manager import KVCacheManager
from kvcache.spec import CacheSpec

BLOCK_SIZE = 4
DENSE = CacheSpec(num_kv_heads=1, head_dim=2, attention_layers=(0, 1))
HYBRID = CacheSpec(
    num_kv_heads=1,
    head_dim=2,
    attention_layers=(1,),
    mamba_layers=(0,),
    conv_state_shape=(4, 3),
    ssm_state_shape=(1, 2, 2),
)
# Few distinct prefixes so prompts often share full blocks.
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5], [])
TOKENS = st.integers(0, 3)
MACHINE_SETTINGS = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class ManagerMachine(RuleBasedStateMachine):
    manager_name = "v1"
    spec = DENSE
    reuse = False

    def __init__(self) -> None:
        super().__init__()
        self.manager: KVCacheManager = create_manager(
            self.manager_name, self.spec, 11, BLOCK_SIZE, 3, enable_block_reuse=self.reuse
        )
        self.running: dict[str, list[int]] = {}
        self.transferring: dict[str, list[int]] = {}
        # What each physical block holds, for full blocks whose KV was computed.
        self.content: dict[int, tuple[int, ...]] = {}
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _record(self, request_id: str, tokens: list[int], before: list[int]) -> None:
        table = self.manager.block_table(request_id)
        assert table[: len(before)] == before, "a table only grows at its tail"
        for j, block_id in enumerate(table):
            if j >= len(before):
                self.content.pop(block_id, None)
            chunk = tuple(tokens[j * BLOCK_SIZE : (j + 1) * BLOCK_SIZE])
            if len(chunk) == BLOCK_SIZE:
                self.content[block_id] = chunk

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(TOKENS, min_size=1, max_size=6))
    def admit(self, prefix: list[int], tail: list[int]) -> None:
        rid, tokens = self._new_id(), prefix + tail
        hit = self.manager.match_prefix(rid, tokens)
        assert hit % BLOCK_SIZE == 0 and hit < len(tokens)
        assert hit == 0 or self.manager.enable_block_reuse
        matched = self.manager.block_table(rid) if hit else []
        for j, block_id in enumerate(matched):
            assert self.content[block_id] == tuple(tokens[j * BLOCK_SIZE : (j + 1) * BLOCK_SIZE])
        if self.manager.allocate_slots(rid, len(tokens), tokens):
            self.running[rid] = tokens
            self._record(rid, tokens, matched)
        else:
            assert (
                self.manager.block_table(rid) == matched
                if hit
                else not self.manager.has_request(rid)
            )
            self.manager.free(rid)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=TOKENS)
    def append(self, data: st.DataObject, token: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        tokens = [*self.running[rid], token]
        before = self.manager.block_table(rid)
        if self.manager.allocate_slots(rid, len(tokens), tokens):
            self.running[rid] = tokens
            self._record(rid, tokens, before)
        else:
            assert self.manager.block_table(rid) == before

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.manager.free(rid)
        del self.running[rid]
        assert not self.manager.has_request(rid)

    @rule(num_tokens=st.integers(17, 40))
    def burst(self, num_tokens: int) -> None:
        """A long request that forces eviction of cached blocks, then leaves."""
        rid = self._new_id()
        evictions = self.manager.evictions
        # Free blocks that still hold a published prefix: taking one evicts it.
        blocks = self.manager._pool.blocks
        cached = {b for b in self.manager.free_queue_ids() if blocks[b].block_hash is not None}
        if self.manager.allocate_slots(rid, num_tokens):
            taken = set(self.manager.block_table(rid))
            assert self.manager.evictions - evictions == len(taken & cached)
            self._record(rid, [], [])
            self.manager.free(rid)
        else:
            assert self.manager.evictions == evictions

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(TOKENS, min_size=1, max_size=6))
    def transfer_in(self, prefix: list[int], tail: list[int]) -> None:
        rid, tokens = self._new_id(), prefix + tail
        if self.manager.allocate_for_transfer(rid, len(tokens)):
            self.transferring[rid] = tokens
        else:
            assert not self.manager.has_request(rid)

    @precondition(lambda self: self.transferring)
    @rule(data=st.data())
    def transfer_done(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.transferring)))
        tokens = self.transferring.pop(rid)
        self._record(rid, tokens, [])  # the bytes arrived before the call below
        self.manager.finish_transfer(rid, tokens)
        self.running[rid] = tokens

    @precondition(lambda self: self.transferring)
    @rule(data=st.data())
    def transfer_abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.transferring)))
        del self.transferring[rid]
        for block_id in self.manager.block_table(rid):
            self.content.pop(block_id, None)
        self.manager.free(rid)

    @invariant()
    def consistent(self) -> None:
        self.manager.check_integrity()
        held: set[int] = set()
        for rid, tokens in {**self.running, **self.transferring}.items():
            table = self.manager.block_table(rid)
            assert len(table) == -(-len(tokens) // BLOCK_SIZE)
            held.update(table)
        assert self.manager.num_free_blocks + len(held) == self.manager.num_usable_blocks
        if self.manager.mamba_pool is not None:
            slots = {self.manager.mamba_slot(rid) for rid in {**self.running, **self.transferring}}
            assert None not in slots
            assert len(slots) + self.manager.mamba_pool.num_free_slots == 3


class V2ReuseMachine(ManagerMachine):
    manager_name = "v2"
    reuse = True


class HybridV1Machine(ManagerMachine):
    spec = HYBRID


class HybridV2Machine(ManagerMachine):
    manager_name = "v2"
    spec = HYBRID
    reuse = True  # stays off for hybrids; the machine checks that no match happens


TestManagerV1 = ManagerMachine.TestCase
TestManagerV2Reuse = V2ReuseMachine.TestCase
TestHybridV1 = HybridV1Machine.TestCase
TestHybridV2 = HybridV2Machine.TestCase
for _case in (TestManagerV1, TestManagerV2Reuse, TestHybridV1, TestHybridV2):
    _case.settings = MACHINE_SETTINGS
del _case
