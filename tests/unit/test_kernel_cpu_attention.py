"""The C decode-attention kernel for CPU tensors against its plain-torch twin."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from models.kernels import cpu_attention, cpu_build
from models.kernels.cpu_attention import paged_attention_decode_cpu, supported
from models.kernels.paged_attention import paged_attention_decode_ref
from tests.kv_pools import layer_cache

pytestmark = pytest.mark.skipif(
    cpu_build.load("decode_attention") is None, reason="no C compiler to build the CPU kernels"
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
    seq_lens: tuple[int, ...]


CASES = {
    "gqa4": Case(8, 2, 64, 16, (37, 1, 16, 100)),
    # Several key chunks per sequence, two passes of two heads for the scores.
    "gqa8_dim128_long": Case(16, 2, 128, 16, (650, 33, 129)),
    # Dim 80 is padded to whole vector pairs; groups of 3 split 2 + 1.
    "gqa3_dim80": Case(6, 2, 80, 16, (40, 17)),
    "mha_odd_dims": Case(3, 3, 12, 3, (7, 5)),
    "mqa": Case(4, 1, 8, 8, (20, 9, 0)),
}


def _inputs(case: Case, layout: str, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, key/value views of a V1 or V2 pool, shuffled block tables, seq lens."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // case.block_size) for n in case.seq_lens]
    num_blocks = sum(per_seq) + 3
    cache = layer_cache(
        layout, num_blocks, case.block_size, case.kv_heads, case.head_dim, dtype, generator=gen
    )
    key_cache, value_cache = cache.key_cache, cache.value_cache
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(max(per_seq), 1)
    rows, start = [], 0
    for count in per_seq:
        rows.append(ids[start : start + count] + [0] * (width - count))
        start += count
    q = torch.randn(len(case.seq_lens), case.num_heads, case.head_dim, generator=gen).to(dtype)
    return q, key_cache, value_cache, torch.tensor(rows), torch.tensor(case.seq_lens)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("layout", ["v1", "v2"])
def test_matches_reference(
    monkeypatch: pytest.MonkeyPatch, threads: int, dtype: torch.dtype, case_name: str, layout: str
) -> None:
    case = CASES[case_name]
    q, key_cache, value_cache, tables, seq_lens = _inputs(case, layout, dtype)
    assert supported(q, key_cache, value_cache)
    # Work above the threshold runs on torch's thread count: force both paths.
    monkeypatch.setattr(cpu_attention, "_DECODE_BYTES_PER_THREAD", 1 if threads > 1 else 1 << 60)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    scale = case.head_dim**-0.5
    got = paged_attention_decode_cpu(q, key_cache, value_cache, tables, seq_lens, scale)
    want = paged_attention_decode_ref(q, key_cache, value_cache, tables, seq_lens, scale)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCES[dtype])


@pytest.mark.parametrize("flag", ["-mno-avx512bf16", "-mno-avx512f", "-mno-avx"])
def test_narrower_vectors_match_reference(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, flag: str
) -> None:
    """The kernel rebuilt without the bf16 pair dot product (plain 16-lane code), without
    AVX-512 (8-lane vectors) or without AVX (4 lanes)."""
    monkeypatch.setattr(cpu_build, "FLAGS", (*cpu_build.FLAGS, flag))
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setattr(cpu_attention._KERNEL, "_fn", None)
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))
    lib = cpu_build.load("decode_attention")
    if lib is None:
        pytest.skip(f"the compiler does not take {flag}")
    assert Path(lib._name).parent == tmp_path  # the narrower build, not the cached one
    for dtype, case in itertools.product(TOLERANCES, CASES.values()):
        q, key_cache, value_cache, tables, seq_lens = _inputs(case, "v2", dtype, seed=1)
        scale = case.head_dim**-0.5
        got = paged_attention_decode_cpu(q, key_cache, value_cache, tables, seq_lens, scale)
        want = paged_attention_decode_ref(q, key_cache, value_cache, tables, seq_lens, scale)
        torch.testing.assert_close(got.float(), want.float(), **TOLERANCES[dtype])


def test_a_build_without_openmp_splits_work_over_its_own_threads(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(cpu_build, "OPENMP_FLAGS", ())
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setattr(cpu_attention._KERNEL, "_fn", None)
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cpu_attention, "_DECODE_BYTES_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    lib = cpu_build.load("decode_attention")
    assert lib is not None and Path(lib._name).parent == tmp_path
    case = CASES["gqa4"]
    for dtype in TOLERANCES:
        q, key_cache, value_cache, tables, seq_lens = _inputs(case, "v1", dtype, seed=2)
        got = paged_attention_decode_cpu(q, key_cache, value_cache, tables, seq_lens, 0.3)
        want = paged_attention_decode_ref(q, key_cache, value_cache, tables, seq_lens, 0.3)
        torch.testing.assert_close(got.float(), want.float(), **TOLERANCES[dtype])


def test_threads_follow_the_bytes_of_keys_and_values_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    per_thread = cpu_attention._DECODE_BYTES_PER_THREAD
    kv_heads, dim = 2, 64
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.empty(1, 16, kv_heads, dim, dtype=dtype)
        per_key = kv_heads * dim * 2 * cache.element_size()  # a key and a value row
        for keys, threads in [
            (1, 1),
            (per_thread // per_key, 1),
            (per_thread // per_key + 1, 2),
            (2 * per_thread // per_key + 1, 3),
            (1 << 30, 4),
        ]:
            lens = torch.tensor([keys // 2, keys - keys // 2])
            assert cpu_attention._decode_threads(lens, cache) == threads, (dtype, keys)
    # With a sliding window only the window's keys are read.
    window = per_thread // per_key // 4
    lens = torch.tensor([1 << 20] * 4)
    assert cpu_attention._decode_threads(lens, cache, window) == 1
    assert cpu_attention._decode_threads(lens, cache, window + 1) == 2
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert cpu_attention._decode_threads(torch.tensor([1 << 30]), cache) == 1


def test_sliding_window_attends_to_the_last_keys_only() -> None:
    case = CASES["gqa4"]
    q, key_cache, value_cache, tables, seq_lens = _inputs(case, "v2", torch.float32, seed=3)
    window = 10
    got = paged_attention_decode_cpu(q, key_cache, value_cache, tables, seq_lens, 0.2, window)
    for i, n in enumerate(case.seq_lens):
        start = max(0, n - window)
        rows = [
            (int(tables[i, p // case.block_size]), p % case.block_size) for p in range(start, n)
        ]
        keys = torch.stack([key_cache[b, o] for b, o in rows])  # [n, kv_heads, dim]
        values = torch.stack([value_cache[b, o] for b, o in rows])
        group = case.num_heads // case.kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        probs = torch.softmax(torch.einsum("hd,thd->ht", q[i], keys) * 0.2, dim=-1)
        want = torch.einsum("ht,thd->hd", probs, values)
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-5)


def test_an_empty_sequence_yields_zeros() -> None:
    q, key_cache, value_cache, tables, seq_lens = _inputs(CASES["mqa"], "v1", torch.float32)
    got = paged_attention_decode_cpu(q, key_cache, value_cache, tables, seq_lens, 0.5)
    assert not got[2].any() and got[0].abs().sum() > 0


def test_unsupported_inputs_are_refused() -> None:
    q, key_cache, value_cache, tables, seq_lens = _inputs(CASES["gqa4"], "v1", torch.float16)
    assert not supported(q, key_cache, value_cache)  # fp16 runs in torch
    q32, k32, v32, _, _ = _inputs(CASES["gqa4"], "v1", torch.float32)
    assert not supported(q32, k32.to(torch.bfloat16), v32.to(torch.bfloat16))
    with pytest.raises(cpu_attention.CpuKernelError, match="supported"):
        paged_attention_decode_cpu(q, key_cache, value_cache, tables, seq_lens, 0.5)


def test_disabled_or_unbuildable_kernels_fall_back(
    monkeypatch: pytest.MonkeyPatch,
    kernel_switch: Callable[[str, str | None], None],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    kernel_switch(cpu_build.ENABLE_ENV, "0")
    assert cpu_build.load("decode_attention") is None
    kernel_switch(cpu_build.ENABLE_ENV, None)
    # A compiler that fails: the build is refused with a warning, nothing is cached.
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cpu_build, "_compiler", lambda: "false")
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        assert cpu_build.load("decode_attention") is None
    assert "building CPU kernel decode_attention failed" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_a_built_library_is_cached_and_reused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))
    assert cpu_build.load("decode_attention") is not None
    built = list(tmp_path.glob("decode_attention-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(cpu_build, "_loaded", {})
    assert cpu_build.load("decode_attention") is not None
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
