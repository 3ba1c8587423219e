"""Paged decode attention: Triton kernel vs torch twin vs dense attention."""

# ruff: noqa: E402  -- the interpreter switch must precede the kernel imports.
import os

import torch

if not torch.cuda.is_available():
    # Kernels are built when their module is imported: pick the interpreter first.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass

import pytest
import torch.nn.functional as F

from models.kernels.paged_attention import (
    AttentionShapeError,
    num_splits_for,
    paged_attention_decode,
    paged_attention_decode_ref,
)
from tests.kv_pools import layer_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@dataclass(frozen=True)
class Case:
    num_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    seq_lens: tuple[int, ...]


CASES = {
    "gqa4": Case(num_heads=8, kv_heads=2, head_dim=16, block_size=4, seq_lens=(13, 1, 16)),
    "mha_odd_dims": Case(num_heads=3, kv_heads=3, head_dim=12, block_size=3, seq_lens=(7, 5)),
    "mqa": Case(num_heads=4, kv_heads=1, head_dim=8, block_size=8, seq_lens=(20, 9)),
}
# Long enough that the keys split over several programs, one row empty.
LONG = Case(num_heads=8, kv_heads=2, head_dim=16, block_size=16, seq_lens=(600, 0, 37))


def _block_tables(case: Case, num_blocks: int) -> torch.Tensor:
    """Disjoint, shuffled physical blocks per sequence, padded with the null block 0."""
    per_seq = [-(-n // case.block_size) for n in case.seq_lens]
    ids = (torch.randperm(num_blocks - 1) + 1)[: sum(per_seq)].tolist()
    rows, start = [], 0
    for count in per_seq:
        rows.append(ids[start : start + count] + [0] * (max(per_seq) - count))
        start += count
    return torch.tensor(rows, device=DEVICE)


def _caches(case: Case, layout: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Key/value views of a V1 per-layer pool or one layer of a V2 block-major pool."""
    num_blocks = sum(-(-n // case.block_size) for n in case.seq_lens) + 3
    gen = torch.Generator().manual_seed(0)
    cache = layer_cache(
        layout, num_blocks, case.block_size, case.kv_heads, case.head_dim, dtype, DEVICE, gen
    )
    return cache.key_cache, cache.value_cache


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("layout", ["v1", "v2"])
def test_kernel_matches_reference(dtype: torch.dtype, case_name: str, layout: str) -> None:
    case = CASES[case_name]
    torch.manual_seed(0)
    key_cache, value_cache = _caches(case, layout, dtype)
    tables = _block_tables(case, key_cache.shape[0])
    seq_lens = torch.tensor(case.seq_lens, device=DEVICE)
    q = torch.randn(len(case.seq_lens), case.num_heads, case.head_dim, device=DEVICE).to(dtype)
    scale = case.head_dim**-0.5

    got = paged_attention_decode(q, key_cache, value_cache, tables, seq_lens, scale)
    want = paged_attention_decode_ref(q, key_cache, value_cache, tables, seq_lens, scale)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCES[dtype])


def test_reference_equals_dense_attention_over_the_same_tokens() -> None:
    case = CASES["gqa4"]
    torch.manual_seed(1)
    key_cache, value_cache = _caches(case, "v2", torch.float32)
    tables = _block_tables(case, key_cache.shape[0])
    q = torch.randn(len(case.seq_lens), case.num_heads, case.head_dim, device=DEVICE)
    seq_lens = torch.tensor(case.seq_lens, device=DEVICE)
    out = paged_attention_decode(q, key_cache, value_cache, tables, seq_lens, 0.3)
    ref = paged_attention_decode_ref(q, key_cache, value_cache, tables, seq_lens, 0.3)
    for i, n in enumerate(case.seq_lens):
        # Rebuild the sequence's contiguous K/V by walking its block table token by token.
        rows = [(int(tables[i, p // case.block_size]), p % case.block_size) for p in range(n)]
        keys = torch.stack([key_cache[b, o] for b, o in rows]).transpose(0, 1)
        values = torch.stack([value_cache[b, o] for b, o in rows]).transpose(0, 1)
        dense = F.scaled_dot_product_attention(
            q[i][:, None], keys, values, scale=0.3, enable_gqa=True
        )[:, 0]
        torch.testing.assert_close(ref[i], dense, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[i], dense, atol=1e-5, rtol=1e-5)


def test_empty_sequence_yields_zeros_and_out_is_filled_in_place() -> None:
    case = CASES["gqa4"]
    key_cache, value_cache = _caches(case, "v1", torch.float32)
    # int32 tables and lengths, as a CUDA-graph friendly runner would pass them.
    tables = torch.tensor([[3, 1, 0, 0], [0, 0, 0, 0]], device=DEVICE, dtype=torch.int32)
    seq_lens = torch.tensor([6, 0], device=DEVICE, dtype=torch.int32)
    q = torch.randn(2, case.num_heads, case.head_dim, device=DEVICE)
    # A strided destination: every other row of a larger buffer.
    buffer = torch.full((4, case.num_heads, case.head_dim), 7.0, device=DEVICE)
    out = paged_attention_decode(q, key_cache, value_cache, tables, seq_lens, 0.25, out=buffer[::2])
    assert out.data_ptr() == buffer.data_ptr()
    assert not buffer[2].any() and torch.equal(buffer[1], torch.full_like(buffer[1], 7.0))
    want = paged_attention_decode_ref(q, key_cache, value_cache, tables, seq_lens, 0.25)
    torch.testing.assert_close(buffer[0], want[0], atol=1e-5, rtol=1e-5)


def test_rejects_heads_that_are_not_a_multiple_of_kv_heads() -> None:
    key_cache = torch.zeros(4, 4, 3, 8, device=DEVICE)
    q = torch.zeros(1, 4, 8, device=DEVICE)
    tables = torch.zeros(1, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(AttentionShapeError, match="multiple of kv heads"):
        paged_attention_decode(q, key_cache, key_cache, tables, torch.ones(1, device=DEVICE), 1.0)


def _run(case: Case, dtype: torch.dtype, num_splits: int | None) -> None:
    torch.manual_seed(2)
    key_cache, value_cache = _caches(case, "v2", dtype)
    tables = _block_tables(case, key_cache.shape[0])
    seq_lens = torch.tensor(case.seq_lens, device=DEVICE)
    q = torch.randn(len(case.seq_lens), case.num_heads, case.head_dim, device=DEVICE).to(dtype)
    args = (q, key_cache, value_cache, tables, seq_lens, 0.25)
    got = paged_attention_decode(*args, num_splits=num_splits)
    want = paged_attention_decode_ref(*args)
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_context_splits_keys_and_merges_partials(dtype: torch.dtype) -> None:
    assert num_splits_for(len(LONG.seq_lens), LONG.kv_heads, 38 * LONG.block_size) == 3
    _run(LONG, dtype, num_splits=None)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_any_split_count_matches_reference(num_splits: int) -> None:
    """More splits than a short sequence has tiles: the empty splits weigh nothing."""
    _run(CASES["gqa4"], torch.float32, num_splits)


def test_split_count_follows_shapes_only() -> None:
    assert num_splits_for(1, 8, 16) == 1  # short context: one program per kv head
    assert num_splits_for(1, 8, 32768) == 16  # long and few sequences: capped
    assert num_splits_for(256, 8, 32768) == 1  # enough programs already
