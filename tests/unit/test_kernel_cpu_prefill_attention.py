"""The C prefill-attention kernel (prompt chunks, causal, over the paged cache)
against the plain-torch reference, one decode row per query token."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from models.batch import ChunkRows
from models.kernels import cpu_attention, cpu_build
from models.kernels.paged_attention import paged_attention_decode_ref
from tests.kv_pools import layer_cache

pytestmark = pytest.mark.skipif(
    cpu_build.load("prefill_attention") is None, reason="no C compiler to build the CPU kernels"
)

TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
}


@dataclass(frozen=True)
class Case:
    num_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    context_lens: tuple[int, ...]  # keys already cached before each chunk
    chunk_lens: tuple[int, ...]  # the chunk's query tokens


CASES = {
    # SmolLM2's heads: one whole prompt of 16 tiles of 16 tokens x 3 heads.
    "gqa3_prompt": Case(9, 3, 64, 16, (0,), (256,)),
    # Later chunks over cached keys, a chunk shorter than a tile, dim 128.
    "gqa4_chunks_dim128": Case(8, 2, 128, 16, (5, 0, 40), (37, 3, 100)),
    "mha_dim16_block8": Case(4, 4, 16, 8, (0, 7), (20, 9)),
    # 32 query heads per kv head: tiles of 4 tokens (128 rows).
    "mqa_group32": Case(32, 1, 32, 16, (3,), (19,)),
}


def _inputs(
    case: Case, layout: str, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ChunkRows]:
    """q as a view of a fused QKV output, a V1 or V2 pool with shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(case.context_lens, case.chunk_lens, strict=True)]
    per_seq = [-(-n // case.block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    cache = layer_cache(
        layout, num_blocks, case.block_size, case.kv_heads, case.head_dim, dtype, generator=gen
    )
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width, rows, start = max(per_seq), [], 0
    for count in per_seq:
        rows.append(ids[start : start + count] + [0] * (width - count))
        start += count
    tokens = sum(case.chunk_lens)
    qkv = torch.randn(tokens, case.num_heads + 2 * case.kv_heads, case.head_dim, generator=gen)
    q = qkv.to(dtype)[:, : case.num_heads]
    starts = [0, *itertools.accumulate(case.chunk_lens)][:-1]
    chunks = ChunkRows(
        starts=torch.tensor(starts),
        lens=torch.tensor(case.chunk_lens),
        block_tables=torch.tensor(rows),
        seq_lens=torch.tensor(seq_lens),
        query_keys=sum(n * s for n, s in zip(case.chunk_lens, seq_lens, strict=True)),
    )
    return q, cache.key_cache, cache.value_cache, chunks


def _per_token_reference(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, chunks: ChunkRows
) -> torch.Tensor:
    """Every query token as a decode row over its sequence's keys up to its position."""
    tables = chunks.block_tables.repeat_interleave(chunks.lens, dim=0)
    positions = [
        torch.arange(s - n + 1, s + 1) for n, s in zip(chunks.lens, chunks.seq_lens, strict=True)
    ]
    scale = q.shape[2] ** -0.5
    return paged_attention_decode_ref(
        q.float().contiguous(),
        key_cache.float(),
        value_cache.float(),
        tables,
        torch.cat(positions),
        scale,
    )


def _run(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    chunks: ChunkRows,
    window: int | None = None,
) -> torch.Tensor:
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    scale = q.shape[2] ** -0.5
    served = cpu_attention.paged_prefill_attention_if_supported(
        q, key_cache, value_cache, chunks, out, scale, window
    )
    assert served
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("layout", ["v1", "v2"])
def test_matches_reference(
    monkeypatch: pytest.MonkeyPatch, threads: int, dtype: torch.dtype, case_name: str, layout: str
) -> None:
    q, key_cache, value_cache, chunks = _inputs(CASES[case_name], layout, dtype)
    monkeypatch.setattr(cpu_attention, "_PARALLEL_WORK", 0 if threads > 1 else 1 << 60)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    got = _run(q, key_cache, value_cache, chunks)
    want = _per_token_reference(q, key_cache, value_cache, chunks)
    torch.testing.assert_close(got.float(), want, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_sliding_window_matches_the_decode_kernel_per_token(dtype: torch.dtype) -> None:
    """Each token sees its last `window` keys only; the decode kernel (tested
    against torch with windows) gives the same rows one token at a time."""
    case = Case(8, 2, 64, 16, (30, 0), (50, 70))
    q, key_cache, value_cache, chunks = _inputs(case, "v1", dtype, seed=3)
    got = _run(q, key_cache, value_cache, chunks, window=20)
    tables = chunks.block_tables.repeat_interleave(chunks.lens, dim=0)
    positions = torch.cat(
        [torch.arange(s - n + 1, s + 1) for n, s in zip(chunks.lens, chunks.seq_lens, strict=True)]
    )
    want = cpu_attention.paged_attention_decode_cpu(
        q.contiguous(), key_cache, value_cache, tables, positions, 64**-0.5, 20
    )
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCES[dtype])
    unwindowed = _run(q, key_cache, value_cache, chunks)
    assert not torch.allclose(got.float(), unwindowed.float())


def test_writes_only_the_chunks_rows() -> None:
    """Rows of `out` outside the chunks (where the decode rows go) are left alone."""
    q, key_cache, value_cache, chunks = _inputs(CASES["gqa4_chunks_dim128"], "v2", torch.float32)
    keep = torch.tensor([0, 37, 40])  # a token of each chunk stays out
    sub = ChunkRows(
        starts=torch.tensor([1, 38, 41]),
        lens=torch.tensor([36, 2, 99]),
        block_tables=chunks.block_tables,
        seq_lens=chunks.seq_lens,
        query_keys=chunks.query_keys,
    )
    out = torch.full(q.shape, 7.0)
    scale = q.shape[2] ** -0.5
    assert cpu_attention.paged_prefill_attention_if_supported(
        q, key_cache, value_cache, sub, out, scale
    )
    assert torch.equal(out[keep], torch.full_like(out[keep], 7.0))
    want = _per_token_reference(q, key_cache, value_cache, chunks)
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[keep] = False
    torch.testing.assert_close(out[others], want[others], **TOLERANCES[torch.float32])


def test_refuses_what_it_does_not_serve() -> None:
    """A head dim that is no whole number of vectors and fp16 are refused
    untouched; the caller then runs its other path."""
    for dim, dtype in [(12, torch.float32), (64, torch.float16)]:
        case = Case(4, 2, dim, 8, (0,), (9,))
        q, key_cache, value_cache, chunks = _inputs(case, "v1", torch.float32)
        q, key_cache, value_cache = q.to(dtype), key_cache.to(dtype), value_cache.to(dtype)
        out = torch.full(q.shape, 3.0, dtype=dtype)
        assert not cpu_attention.paged_prefill_attention_if_supported(
            q, key_cache, value_cache, chunks, out, 0.5
        )
        assert torch.equal(out, torch.full_like(out, 3.0))


@pytest.mark.parametrize("flag", ["-mno-avx512f", "-mno-avx"])
def test_narrower_vectors_match_reference(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, flag: str
) -> None:
    """The kernel rebuilt without AVX-512 (8-lane vectors) or without AVX (4 lanes)."""
    monkeypatch.setattr(cpu_build, "FLAGS", (*cpu_build.FLAGS, flag))
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setattr(cpu_attention._PREFILL_KERNEL, "_fn", None)
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))
    lib = cpu_build.load("prefill_attention")
    if lib is None:
        pytest.skip(f"the compiler does not take {flag}")
    assert Path(lib._name).parent == tmp_path
    for dtype, case in itertools.product(TOLERANCES, CASES.values()):
        q, key_cache, value_cache, chunks = _inputs(case, "v2", dtype, seed=1)
        got = _run(q, key_cache, value_cache, chunks)
        want = _per_token_reference(q, key_cache, value_cache, chunks)
        torch.testing.assert_close(got.float(), want, **TOLERANCES[dtype])
