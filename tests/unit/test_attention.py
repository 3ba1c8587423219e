"""Paged GQA attention against dense causal attention on the same K/V."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvcache.views import AttentionLayerCache
from models.batch import ForwardBatch
from models.kernels import cpu_build, dispatch
from models.layers import attention
from models.layers.attention import attend, paged_attention, write_kv

# A head dim of whole vectors at any width the C kernels are built for (4, 8, 16 lanes).
HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 4
SCALE = DIM**-0.5


@pytest.fixture(autouse=True, params=["c-kernels", "torch"])
def cpu_kernels(
    request: pytest.FixtureRequest, kernel_switch: Callable[[str, str | None], None]
) -> str:
    """Every test twice on CPU: through the C kernels where they serve (a step
    with prompt tokens runs its chunks through the tiled prefill kernel and its
    decode tokens through the decode kernel), and with them off (the torch
    paths: padded, per-prompt and chunked SDPA calls)."""
    if request.param == "torch":
        kernel_switch(cpu_build.ENABLE_ENV, "0")
    return str(request.param)


def make_step(
    context_lens: list[int], new_lens: list[int], num_blocks: int = 32, seed: int = 0
) -> tuple[ForwardBatch, AttentionLayerCache, list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """A step over shuffled blocks of a block-major pool whose history K/V is already cached.

    Returns the batch, the cache, each sequence's full K and V (history + new),
    and the new tokens' queries.
    """
    gen = torch.Generator().manual_seed(seed)
    pool = torch.zeros(num_blocks, 3, 2, BLOCK, KV_HEADS, DIM)  # [blocks, layers, 2, ...]
    cache = AttentionLayerCache(pool[:, 1, 0], pool[:, 1, 1])
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, slots, positions, keys, values = [], [], [], [], []
    for ctx, new in zip(context_lens, new_lens, strict=True):
        total = ctx + new
        blocks = [free.pop() for _ in range(-(-total // BLOCK))]
        tables.append(blocks)
        k = torch.randn(total, KV_HEADS, DIM, generator=gen)
        v = torch.randn(total, KV_HEADS, DIM, generator=gen)
        for pos in range(ctx):  # history written by earlier steps
            cache.key_cache[blocks[pos // BLOCK], pos % BLOCK] = k[pos]
            cache.value_cache[blocks[pos // BLOCK], pos % BLOCK] = v[pos]
        for pos in range(ctx, total):
            slots.append(blocks[pos // BLOCK] * BLOCK + pos % BLOCK)
            positions.append(pos)
        keys.append(k)
        values.append(v)
    width = max(len(t) for t in tables)
    starts = torch.tensor([0, *new_lens]).cumsum(0)
    batch = ForwardBatch(
        input_ids=torch.zeros(sum(new_lens), dtype=torch.int64),
        positions=torch.tensor(positions),
        query_start_loc=starts,
        seq_lens=torch.tensor(context_lens) + torch.tensor(new_lens),
        context_lens=torch.tensor(context_lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        slot_mapping=torch.tensor(slots),
        block_size=BLOCK,
    )
    q = torch.randn(sum(new_lens), HEADS, DIM, generator=gen)
    return batch, cache, keys, values, q


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int, window: int | None
) -> torch.Tensor:
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    q_pos = torch.arange(ctx, ctx + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def run_and_compare(
    context_lens: list[int], new_lens: list[int], window: int | None, num_blocks: int = 32
) -> None:
    batch, cache, keys, values, q = make_step(context_lens, new_lens, num_blocks)
    new_k = torch.cat([k[c:] for k, c in zip(keys, context_lens, strict=True)])
    new_v = torch.cat([v[c:] for v, c in zip(values, context_lens, strict=True)])
    out = paged_attention(q, new_k, new_v, cache, batch, SCALE, window)
    starts = batch.query_start_loc.tolist()
    for i, ctx in enumerate(context_lens):
        expected = dense_reference(q[starts[i] : starts[i + 1]], keys[i], values[i], ctx, window)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 3], ids=["full", "sliding-3"])
def test_mixed_prefill_chunks_and_decode_tokens(window: int | None) -> None:
    # A chunk continuing a cached prefix mid-block, a fresh prompt, a decode token.
    run_and_compare(context_lens=[5, 0, 9], new_lens=[6, 4, 1], window=window)


@pytest.mark.parametrize("window", [None, 3], ids=["full", "sliding-3"])
def test_decode_tokens_between_prompt_chunks(window: int | None) -> None:
    # Decodes of uneven lengths (run as one batched call) interleaved with a
    # fresh prompt, a continuing chunk and a one-token prompt.
    run_and_compare(context_lens=[12, 0, 3, 5, 7, 0], new_lens=[1, 4, 1, 6, 1, 1], window=window)


@pytest.mark.parametrize("window", [None, 5], ids=["full", "sliding-5"])
def test_decode_only_batch_of_uneven_lengths(window: int | None) -> None:
    run_and_compare(context_lens=[0, 12, 3, 7], new_lens=[1, 1, 1, 1], window=window)


def test_new_kv_lands_in_the_pool_slots() -> None:
    batch, cache, keys, values, q = make_step([2], [3])
    paged_attention(q, keys[0][2:], values[0][2:], cache, batch, SCALE)
    block = int(batch.block_tables[0, 1])  # positions 4.. live in the second block
    torch.testing.assert_close(cache.key_cache[block, 0], keys[0][4])
    torch.testing.assert_close(cache.value_cache[block, 0], values[0][4])


@pytest.mark.skipif(not dispatch.kernels_interpreted(), reason="kernels compiled for a GPU")
def test_decode_through_the_triton_kernel_matches(
    kernel_switch: Callable[[str, str | None], None],
) -> None:
    batch, cache, keys, values, q = make_step([3, 10], [1, 1])
    new_k = torch.stack([keys[0][3], keys[1][10]])
    new_v = torch.stack([values[0][3], values[1][10]])
    torch_out = paged_attention(q, new_k, new_v, cache, batch, SCALE)
    kernel_switch(dispatch.FORCE_TRITON_ENV, "1")
    kernel_out = paged_attention(q, new_k, new_v, cache, batch, SCALE)
    torch.testing.assert_close(kernel_out, torch_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 3], ids=["full", "sliding-3"])
@pytest.mark.parametrize("new_lens", [[6, 2, 9], [5, 5, 5]], ids=["uneven", "equal"])
def test_fresh_prompts_attend_in_one_padded_call(new_lens: list[int], window: int | None) -> None:
    # Every sequence starts at position 0: the padded (or, equal lengths, plain
    # reshaped) batch path; padding must not leak into any sequence.
    run_and_compare(context_lens=[0] * len(new_lens), new_lens=new_lens, window=window)


@pytest.mark.parametrize("window", [None, 7], ids=["full", "sliding-7"])
@pytest.mark.parametrize("new_lens", [[40, 3, 33], [48], [36, 36]], ids=["uneven", "one", "equal"])
def test_long_fresh_prompts_attend_causally_per_prompt(
    new_lens: list[int], window: int | None
) -> None:
    # Prompts past the padded-batch length: SDPA's causal mask per prompt (or
    # once for equal lengths) over the step's own K/V.
    run_and_compare(context_lens=[0] * len(new_lens), new_lens=new_lens, window=window)


@pytest.mark.parametrize("window", [None, 3], ids=["full", "sliding-3"])
def test_fresh_chunk_beside_continuing_chunks_and_decodes(window: int | None) -> None:
    # A step that also carries cached tokens: a chunk starting its prompt attends
    # over its own new K/V, the others read theirs back from the cache.
    run_and_compare(context_lens=[0, 6, 10, 0], new_lens=[9, 5, 1, 2], window=window)


def test_prompt_steps_read_every_key_from_the_cache_through_the_c_kernel(
    cpu_kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With the C kernels a step with prompt tokens attends over the cache alone:
    # the K/V passed in are not read (here zeros), only what the cache holds.
    if cpu_kernels == "torch":
        pytest.skip("the torch paths read a fresh prompt's K/V from the arguments")
    served: list[bool] = []
    prefill = dispatch.cpu_prefill_attention
    monkeypatch.setattr(
        dispatch, "cpu_prefill_attention", lambda *args: served.append(prefill(*args)) or served[-1]
    )
    batch, cache, keys, values, q = make_step([0, 6, 3], [9, 5, 1])
    write_kv(
        torch.cat([keys[0], keys[1][6:], keys[2][3:]]),
        torch.cat([values[0], values[1][6:], values[2][3:]]),
        cache,
        batch,
    )
    zeros = torch.zeros(batch.num_tokens, KV_HEADS, DIM)
    out = attend(q, zeros, zeros, cache, batch, SCALE)
    starts = batch.query_start_loc.tolist()
    for i, ctx in enumerate([0, 6, 3]):
        expected = dense_reference(q[starts[i] : starts[i + 1]], keys[i], values[i], ctx, None)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], expected, rtol=1e-5, atol=1e-5)
    assert served == [True]  # the chunks went through the tiled prefill kernel


@pytest.mark.parametrize("window", [None, 3], ids=["full", "sliding-3"])
def test_a_step_with_a_sequence_past_1024_tokens_matches_dense_attention(
    window: int | None,
) -> None:
    # Past 1,024 tokens the tiled kernel still serves, where per-token rows would not.
    run_and_compare(context_lens=[1030, 0], new_lens=[3, 5], window=window, num_blocks=300)


@pytest.mark.parametrize("window", [None, 3], ids=["full", "sliding-3"])
def test_a_step_with_a_sequence_past_2048_tokens_matches_dense_attention(
    window: int | None,
) -> None:
    # Past 2,048 tokens the CPU step leaves the C kernels for SDPA's tiles.
    run_and_compare(context_lens=[2050, 0], new_lens=[3, 5], window=window, num_blocks=530)


@pytest.mark.parametrize("window", [None, 3], ids=["full", "sliding-3"])
def test_prompt_tokens_as_decode_rows_where_the_tiled_kernel_does_not_serve(
    cpu_kernels: str, monkeypatch: pytest.MonkeyPatch, window: int | None
) -> None:
    # A head dim the prefill kernel refuses (or a step beyond its limit, as
    # here) runs every prompt token as a row of the decode kernel.
    if cpu_kernels == "torch":
        pytest.skip("the decode kernel is one of the C kernels")
    monkeypatch.setattr(attention, "_TILED_MAX_LEN", 0)
    called: list[int] = []
    decode = dispatch.cpu_decode_attention
    monkeypatch.setattr(
        dispatch,
        "cpu_decode_attention",
        lambda q, *args: called.append(q.shape[0]) or decode(q, *args),
    )
    run_and_compare(context_lens=[0, 6, 10, 0], new_lens=[9, 5, 1, 2], window=window)
    assert called == [17]  # every token in one call
