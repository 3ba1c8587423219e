"""Head-slice plans between tensor-parallel ranks: every head a puller rank
needs arrives once, from the holder rank that owns it, in either manager."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from kvcache.factory import create_manager
from kvcache.manager import KVCacheManager
from kvcache.spec import CacheSpec
from kvcache.tensors import CacheTensors, allocate_cache_tensors
from models.config import MambaConfig, ModelConfig
from models.sharding import shard_config
from tests.head_shards import HYBRID_WHOLE, WholeCache, assert_equal, read, write
from transfer.errors import LayoutMismatch
from transfer.head_slices import SlicePair, _progressions, plan_pull
from transfer.plan import Runs

BLOCK_SIZE = 4
NUM_TOKENS = 3 * BLOCK_SIZE - 1  # three blocks, the last one partly filled
DENSE_KV4 = CacheSpec(num_kv_heads=4, head_dim=8, attention_layers=(0, 1, 2))
DENSE_KV1 = replace(DENSE_KV4, num_kv_heads=1)
# One B/C group: every rank keeps it (replicated), one holder rank sends it.
HYBRID_ONE_GROUP = replace(HYBRID_WHOLE, conv_state_shape=(4 * 4 + 2 * 8, 3))


@dataclass
class Rank:
    manager: KVCacheManager
    tensors: CacheTensors


def make_rank(whole: CacheSpec, rank: int, size: int, manager: str, pad_blocks: int = 0) -> Rank:
    spec = whole.for_rank(rank, size)
    mgr = create_manager(manager, spec, 16, BLOCK_SIZE, 4)
    if pad_blocks:  # another request first, so block ids differ from the holder's
        assert mgr.allocate_slots("pad", pad_blocks * BLOCK_SIZE)
    return Rank(mgr, allocate_cache_tensors(mgr))


def apply(pairs: list[SlicePair], src: CacheTensors, dst: CacheTensors) -> int:
    """Copy what the pairs describe, run by run, as a transceiver would; bytes moved."""
    moved = 0
    for p in pairs:
        for (s, n), (d, _) in zip(p.source_runs(), p.dest_runs(), strict=True):
            dst.raw[p.dst_buffer][d : d + n] = src.raw[p.src_buffer][s : s + n]
            moved += n
    return moved


def pull_all(holders: list[Rank], puller: Rank) -> tuple[int, list[list[SlicePair]]]:
    rid = "req"
    assert puller.manager.allocate_for_transfer(rid, NUM_TOKENS)
    dest = puller.manager.layout_signature()
    moved, plans = 0, []
    for holder in holders:
        source = holder.manager.layout_signature().to_dict()
        src_regions = holder.manager.regions(rid)
        pairs = plan_pull(rid, source, src_regions, dest, puller.manager.regions(rid))
        plans.append(pairs)
        moved += apply(pairs, holder.tensors, puller.tensors)
    return moved, plans


CASES = [
    (DENSE_KV4, 1, 2),
    (DENSE_KV4, 2, 1),
    (DENSE_KV4, 2, 4),
    (DENSE_KV4, 4, 2),
    (DENSE_KV4, 2, 2),
    (DENSE_KV1, 2, 1),
    (DENSE_KV1, 1, 2),
    (DENSE_KV1, 2, 2),
    (HYBRID_WHOLE, 1, 1),
    (HYBRID_WHOLE, 2, 1),
    (HYBRID_WHOLE, 1, 2),
    (HYBRID_WHOLE, 2, 4),
    (HYBRID_WHOLE, 4, 2),
    (HYBRID_WHOLE, 2, 2),
    (HYBRID_ONE_GROUP, 2, 1),
    (HYBRID_ONE_GROUP, 1, 2),
]


@pytest.mark.parametrize("managers", [("v2", "v2"), ("v1", "v1"), ("v1", "v2"), ("v2", "v1")])
@pytest.mark.parametrize("whole,ctx_size,gen_size", CASES)
def test_every_puller_rank_gets_its_heads_once(
    whole: CacheSpec, ctx_size: int, gen_size: int, managers: tuple[str, str]
) -> None:
    cache = WholeCache(whole, BLOCK_SIZE, num_blocks=3)
    holders = [make_rank(whole, r, ctx_size, managers[0]) for r in range(ctx_size)]
    for holder in holders:
        assert holder.manager.allocate_slots("req", NUM_TOKENS)
        shard = holder.manager.layout.spec.heads
        write(holder.tensors, holder.manager, "req", cache.slice_for(shard))
    for s in range(gen_size):
        puller = make_rank(whole, s, gen_size, managers[1], pad_blocks=2)
        moved, _ = pull_all(holders, puller)
        shard = puller.manager.layout.spec.heads
        assert_equal(read(puller.tensors, puller.manager, "req"), cache.slice_for(shard))
        # Each byte of the destination is written by exactly one holder rank.
        assert moved == puller.manager.regions("req").num_bytes


def test_head_slices_of_adjacent_blocks_merge_into_one_strided_read() -> None:
    holders = [make_rank(DENSE_KV4, r, 2, "v2") for r in range(2)]
    for holder in holders:
        assert holder.manager.allocate_slots("req", NUM_TOKENS)
    _, plans = pull_all(holders, make_rank(DENSE_KV4, 0, 1, "v2", pad_blocks=2))
    # Three blocks of three layers: one read per holder, of 3 runs, each a
    # holder's two heads of a block through all layers (head-outer).
    assert [len(pairs) for pairs in plans] == [1, 1]
    (pair,) = plans[1]
    piece = 2 * BLOCK_SIZE * 8 * 4  # one head's keys and values of a layer's block
    assert (pair.run, pair.num_runs) == (2 * 3 * piece, 3)
    assert (pair.src_stride, pair.dst_stride) == (2 * 3 * piece, 4 * 3 * piece)


def test_a_head_slice_of_a_block_is_one_run_per_keys_and_values() -> None:
    """2 -> 4 on V1: a puller rank's one head of each layer's block is one run
    of its keys and values, whatever the blocks' order on either side."""
    holder = make_rank(DENSE_KV4, 1, 2, "v1")
    assert holder.manager.allocate_slots("req", NUM_TOKENS)
    _, (pairs,) = pull_all([holder], make_rank(DENSE_KV4, 3, 4, "v1", pad_blocks=2))
    piece = 2 * BLOCK_SIZE * 8 * 4
    assert {pair.run for pair in pairs} == {piece}
    assert sum(pair.num_runs for pair in pairs) == 3 * 3


def test_replicated_kv_head_is_read_from_the_lowest_holder_only() -> None:
    holders = [make_rank(DENSE_KV1, r, 2, "v2") for r in range(2)]
    for holder in holders:
        assert holder.manager.allocate_slots("req", NUM_TOKENS)
    _, plans = pull_all(holders, make_rank(DENSE_KV1, 0, 1, "v2"))
    assert plans[0] and not plans[1]


def refused_plan(
    holder: Rank, puller: Rank, puller_tokens: int = NUM_TOKENS, **source: object
) -> str:
    """The `LayoutMismatch` planning a pull raises, as text; `source` overrides
    fields of the holder's signature."""
    assert holder.manager.allocate_slots("req", NUM_TOKENS)
    assert puller.manager.allocate_for_transfer("req", puller_tokens)
    signature = {**holder.manager.layout_signature().to_dict(), **source}
    with pytest.raises(LayoutMismatch) as refused:
        plan_pull(
            "req",
            signature,
            holder.manager.regions("req"),
            puller.manager.layout_signature(),
            puller.manager.regions("req"),
        )
    return str(refused.value)


def test_shards_of_different_models_are_refused_before_any_byte_moves() -> None:
    other = make_rank(replace(DENSE_KV4, head_dim=16), 0, 1, "v2")
    assert "head_dim" in refused_plan(make_rank(DENSE_KV4, 0, 2, "v2"), other)


@pytest.mark.parametrize("order", ["token_major", "head_major"])
@pytest.mark.parametrize("same_heads", [True, False])
def test_a_holder_of_another_kv_order_is_refused_before_any_byte_moves(
    same_heads: bool, order: str
) -> None:
    holder = make_rank(DENSE_KV4, 0, 1 if same_heads else 2, "v2")
    refused = refused_plan(holder, make_rank(DENSE_KV4, 0, 1, "v1"), kv_order=order)
    assert "kv_order" in refused


def test_head_ranges_off_the_sharding_rule_are_refused() -> None:
    holder, puller = make_rank(DENSE_KV4, 1, 2, "v2"), make_rank(DENSE_KV4, 0, 1, "v2")
    # Rank 1 of 2 holds heads 2 and 3.
    assert "sharding rule" in refused_plan(holder, puller, kv_heads=[0, 2])


def test_missing_blocks_on_the_puller_are_refused() -> None:
    holder, puller = make_rank(DENSE_KV4, 0, 2, "v2"), make_rank(DENSE_KV4, 0, 1, "v2")
    assert "kv_segments" in refused_plan(holder, puller, puller_tokens=BLOCK_SIZE)


LLAMA = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=64,
    hidden_size=32,
    layer_types=("decoder",) * 2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
)
NEMOTRON_H = replace(
    LLAMA,
    architecture="NemotronHForCausalLM",
    layer_types=("mamba", "attention", "mlp", "mamba"),
    mamba=MambaConfig(
        num_heads=4, head_dim=8, state_size=8, n_groups=2, conv_kernel=4, chunk_size=8
    ),
)


@pytest.mark.parametrize(
    "config,size",
    [
        (LLAMA, 2),
        (replace(LLAMA, num_key_value_heads=1), 2),
        (NEMOTRON_H, 2),
        # One B/C group: every rank keeps it.
        (replace(NEMOTRON_H, mamba=replace(NEMOTRON_H.mamba, n_groups=1)), 2),
    ],
)
def test_a_rank_model_cache_is_the_whole_cache_for_that_rank(
    config: ModelConfig, size: int
) -> None:
    whole = config.cache_spec()
    for rank in range(size):
        assert shard_config(config, rank, size).cache_spec() == whole.for_rank(rank, size)


def test_a_whole_spec_knows_its_heads() -> None:
    heads = HYBRID_WHOLE.heads
    assert (heads.kv_heads, heads.mamba_heads, heads.mamba_groups) == ((0, 4), (0, 4), (0, 2))
    assert torch.Size(HYBRID_WHOLE.for_rank(1, 2).conv_state_shape) == (2 * 4 + 2 * 8, 3)


def _greedy_progressions(runs: list[tuple[str, int, str, int, int]]) -> list[SlicePair]:
    """The definition, one run at a time: a run and the next set the steps
    (each at least a run), and the pair extends while later runs keep them."""
    pairs, i = [], 0
    while i < len(runs):
        sb, so, db, do, n = runs[i]
        count, steps = 1, (n, n)
        if i + 1 < len(runs) and runs[i + 1][0::2] == (sb, db, n):
            step = (runs[i + 1][1] - so, runs[i + 1][3] - do)
            if min(step) >= n:
                steps = step
                while i + count < len(runs) and runs[i + count] == (
                    sb,
                    so + count * step[0],
                    db,
                    do + count * step[1],
                    n,
                ):
                    count += 1
        pairs.append(SlicePair(sb, so, db, do, n, count, *(steps if count > 1 else (n, n))))
        i += count
    return pairs


@pytest.mark.parametrize("seed", range(40))
def test_runs_become_the_same_strided_pairs_as_taken_one_by_one(seed: int) -> None:
    """Random runs with stretches of equal steps, breaks, buffer changes,
    overlapping and shrinking steps, against the one-run-at-a-time definition."""
    rng = random.Random(seed)
    runs: list[tuple[str, int, str, int, int]] = []
    so, do = 0, 0
    for _ in range(rng.randrange(0, 60)):
        if rng.random() < 0.3 or not runs:
            step = (rng.choice([4, 8, 12, 3]), rng.choice([4, 8, 16, 2]))
        so, do = so + step[0], do + step[1]
        runs.append((rng.choice("aab"), so, rng.choice("ccd"), do, rng.choice([4, 4, 4, 8])))
    names = sorted({r[0] for r in runs} | {r[2] for r in runs})
    code = {name: i for i, name in enumerate(names)}
    arrays = Runs(
        names,
        *(
            np.array(column, dtype=np.int64)
            for column in (
                [code[r[0]] for r in runs],
                [r[1] for r in runs],
                [code[r[2]] for r in runs],
                [r[3] for r in runs],
                [r[4] for r in runs],
            )
        ),
    )
    assert _progressions(arrays) == _greedy_progressions(runs)
