"""Part 3: every Triton kernel, compiled for the device, against its `_ref` twin.

Shapes follow a real decode step (a V2 block-major pool, GQA, 16-token
blocks); `scale` grows them on a GPU and keeps them small under the CPU
interpreter. The first call of each kernel includes its compilation, which
is reported. Each row says whether its kernels ran compiled or in the
interpreter (`TRITON_INTERPRET=1`, where bf16 is computed in fp32, so the
compiled bf16 `tl.dot` path of the attention kernel never runs): on CUDA a
row passes only compiled; under `--device cpu` the compiled and bf16 rows
are listed as needing CUDA.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from benchmarks.gpu_check.report import needs_cuda
from models.kernels import block_copy, mamba_state_update, paged_attention

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def _row(
    name: str, dtype: str, got: torch.Tensor, want: torch.Tensor, first_s: float
) -> dict[str, Any]:
    """Error relative to the largest reference value (sums of many products grow)."""
    scale = float(want.float().abs().max()) if want.numel() else 1.0
    err = (
        float((got.float() - want.float()).abs().max()) / max(scale, 1e-30) if got.numel() else 0.0
    )
    tol = TOLERANCES[DTYPES[dtype]]
    return {
        "kernel": name,
        "dtype": dtype,
        "max_rel_error": err,
        "first_call_s": first_s,
        "ok": err <= tol,
    }


def _attention(device: str, dtype: str, seq_lens: list[int]) -> dict[str, Any]:
    torch_dtype, block_size, heads, kv_heads, head_dim = DTYPES[dtype], 16, 16, 4, 64
    width = -(-max(seq_lens) // block_size)
    num_blocks = width * len(seq_lens) + 1
    # Two layers of a V2 pool, head-outer blocks as `kvcache.pool_layout` lays them out.
    pool = torch.randn(num_blocks, kv_heads, 2, 2, block_size, head_dim, device=device)
    pool = pool.to(torch_dtype)
    key, value = pool[:, :, 1, 0].transpose(1, 2), pool[:, :, 1, 1].transpose(1, 2)
    ids = (torch.randperm(num_blocks - 1, device=device) + 1)[: width * len(seq_lens)]
    tables = ids.view(len(seq_lens), width)
    lens = torch.tensor(seq_lens, device=device)
    q = torch.randn(len(seq_lens), heads, head_dim, device=device).to(torch_dtype)
    args = (q, key, value, tables, lens, head_dim**-0.5)
    got, first = _timed(lambda: paged_attention.paged_attention_decode(*args))
    splits = paged_attention.num_splits_for(len(seq_lens), kv_heads, width * block_size)
    name = f"paged_attention_decode (max {max(seq_lens)} keys, {splits} split)"
    return _row(name, dtype, got, paged_attention.paged_attention_decode_ref(*args), first)


def _mamba(device: str, dtype: str, batch: int) -> dict[str, Any]:
    torch_dtype, heads, head_dim, dstate, groups = DTYPES[dtype], 16, 64, 64, 4
    state = torch.randn(batch + 3, 2, heads, head_dim, dstate, device=device)[:, 1]
    slots = torch.randperm(batch + 3, device=device)[:batch]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device).to(torch_dtype)

    args = (
        slots, rand(batch, heads, head_dim), rand(batch, heads),
        torch.randn(heads, device=device), -torch.rand(heads, device=device),
        rand(batch, groups, dstate), rand(batch, groups, dstate), torch.randn(heads, device=device),
    )  # fmt: skip
    ours, ref = state.clone(), state.clone()
    got, first = _timed(lambda: mamba_state_update.mamba_state_update(ours, *args))
    want = mamba_state_update.mamba_state_update_ref(ref, *args)
    row = _row("mamba_state_update", dtype, got, want, first)
    # The new state is kept in float32 whatever the input dtype.
    row["ok"] = row["ok"] and bool(torch.allclose(ours, ref, atol=1e-4, rtol=1e-4))
    return row


def _block_copies(device: str, dtype: str, num_blocks: int) -> list[dict[str, Any]]:
    torch_dtype = DTYPES[dtype]
    pool = torch.randn(num_blocks, 3, 2, 16, 4, 64, device=device).to(torch_dtype)
    ids = torch.randperm(num_blocks, device=device)[: num_blocks // 2]
    staging, first = _timed(lambda: block_copy.gather_blocks(pool, ids))
    rows = [_row("gather_blocks", dtype, staging, block_copy.gather_blocks_ref(pool, ids), first)]
    ours, ref, layer = pool.clone(), pool.clone(), staging[:, 0].contiguous()
    _, first = _timed(lambda: block_copy.scatter_blocks(ours[:, 1], ids, layer))
    block_copy.scatter_blocks_ref(ref[:, 1], ids, layer)
    rows.append(_row("scatter_blocks", dtype, ours, ref, first))
    dst_ids = ids.flip(0)
    _, first = _timed(lambda: block_copy.copy_blocks(pool[:, 0], ids, ours[:, 2], dst_ids))
    block_copy.copy_blocks_ref(pool[:, 0], ids, ref[:, 2], dst_ids)
    rows.append(_row("copy_blocks", dtype, ours, ref, first))
    for row in rows:  # copies are exact
        row["ok"] = row["max_rel_error"] == 0.0
    return rows


KERNELS = ("paged_attention_decode", "mamba_state_update", "block copies")


def triton_mode() -> str:
    """How Triton kernels run in this process: "interpreted" or "compiled"."""
    return "interpreted" if os.environ.get("TRITON_INTERPRET") == "1" else "compiled"


def check_kernels(device: str, scale: int, dtypes: Iterable[str] = DTYPES) -> list[dict[str, Any]]:
    """`scale` 1 for the CPU interpreter; larger multiplies lengths and batches."""
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    for dtype in dtypes:
        rows.append(_attention(device, dtype, [37 * scale, 1, 16 * scale]))
        # Few sequences, long context: the keys split over programs.
        rows.append(_attention(device, dtype, [600 * scale]))
        rows.append(_mamba(device, dtype, 3 * scale))
        rows.extend(_block_copies(device, dtype, 8 * scale))
    mode = triton_mode()
    for row in rows:
        row["mode"] = mode
        row["ok"] = row["ok"] and (device != "cuda" or mode == "compiled")
    if device != "cuda":
        rows += [
            needs_cuda("compiled Triton kernel against its torch twin", kernel=name, dtype=dtype)
            for dtype in DTYPES
            for name in KERNELS
        ]
    return rows
