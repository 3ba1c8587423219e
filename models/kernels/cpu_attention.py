"""Paged decode attention on CPU through the C kernel in `csrc/decode_attention.c`.

Same contract as `models.kernels.paged_attention` (see its docstring), plus an
optional sliding window. The kernel reads K/V in place through the block
table, so a decode step neither gathers the cache into a copy nor pads it to
the longest sequence, and it runs with the GIL released.

`supported(...)` says whether a call can take this path (fp32 or bf16
everywhere, head dim contiguous, the library built); otherwise callers run
their torch implementation.
"""

from __future__ import annotations

import ctypes

import torch

from models.kernels import cpu_build
from models.kernels.paged_attention import check_decode_inputs

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Fixed-size buffers in the kernel (query heads per kv head, head dim).
_MAX_GROUP, _MAX_DIM = 64, 512
# Below this many multiply-adds per call one thread is faster than starting more.
_PARALLEL_WORK = 1 << 18

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class CpuKernelError(RuntimeError):
    """The C kernel refused its inputs or ran out of memory or threads."""


def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load("decode_attention")
    if lib is not None and lib.paged_decode_attention.argtypes is None:
        fn = lib.paged_decode_attention
        fn.argtypes = [_INT, _P, _P, _P, _I64, _I64, _I64, _P, _I64, _P, _P]
        fn.argtypes += [_INT] * 6 + [ctypes.c_float, _INT]
        fn.restype = ctypes.c_int
    return lib


def supported(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether `paged_attention_decode_cpu` serves these tensors."""
    if q.device.type != "cpu" or q.dtype not in _DTYPES:
        return False
    if key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
        return False
    if key_cache.stride() != value_cache.stride() or key_cache.stride(3) != 1:
        return False
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = key_cache.shape[2]
    if heads % kv_heads or heads // kv_heads > _MAX_GROUP or dim > _MAX_DIM:
        return False
    return _library() is not None


def paged_attention_decode_cpu(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`[B, heads, dim]` in q's dtype; call only where `supported(...)` holds."""
    check_decode_inputs(q, key_cache, value_cache, block_tables, seq_lens)
    lib = _library()
    if lib is None or not supported(q, key_cache, value_cache):
        raise CpuKernelError("the CPU decode kernel does not serve these inputs; check supported()")
    q = q.contiguous()
    tables = block_tables.to(torch.int64)
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    batch, heads, dim = q.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    work = int(lens.sum()) * heads * dim
    threads = torch.get_num_threads() if work >= _PARALLEL_WORK else 1
    status = lib.paged_decode_attention(
        _DTYPES[q.dtype],
        q.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        tables.data_ptr(),
        tables.stride(0),
        lens.data_ptr(),
        out.data_ptr(),
        batch,
        heads,
        kv_heads,
        dim,
        block_size,
        sliding_window or 0,
        scale,
        threads,
    )
    if status != 0:
        raise CpuKernelError(
            "the CPU decode kernel failed "
            + ("(shape beyond its limits)" if status == 1 else "(out of memory or threads)")
        )
    return out
