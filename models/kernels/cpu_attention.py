"""Paged attention on CPU through the C kernels in `csrc/`: decode
(`decode_attention.c`, one query token per sequence) and prompt chunks
(`prefill_attention.c`, several query tokens per sequence, causal).

Same contract as `models.kernels.paged_attention` (see its docstring), plus an
optional sliding window. The kernel reads K/V in place through the block
table, so a decode step neither gathers the cache into a copy nor pads it to
the longest sequence, and it runs with the GIL released.

`supported(...)` says whether a call can take this path (fp32 or bf16
everywhere, head dim contiguous, the library built); otherwise callers run
their torch implementation.

A decode step calls this once per attention layer, so the Python side is kept
to a few attribute reads: the ctypes function is set up once, and the inputs
are converted only when they are not already what the kernel reads.
"""

from __future__ import annotations

import ctypes

import torch

from models.batch import ChunkRows
from models.kernels import cpu_build
from models.kernels.paged_attention import check_decode_inputs

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Fixed-size buffers in the kernel (query heads per kv head, head dim).
_MAX_GROUP, _MAX_DIM = 64, 512
# Multiply-adds (keys x heads x dim) per thread a prefill call needs before
# it uses another. The threads are the OpenMP team torch already runs (a few
# us to wake), and 2^19 multiply-adds take several times that on one thread
# (docs/performance.md, "CPU kernels").
_PARALLEL_WORK = 1 << 19
# Bytes of keys and values per thread a decode call reads: it streams them
# from memory (a step's other layers and products pass between two reads of
# a layer's cache), so its threads follow the bytes: in SmolLM2 decode steps
# a second thread paid off from about 1.5 MB a call and lost below 1 MB
# (docs/performance.md, "CPU kernels").
_DECODE_BYTES_PER_THREAD = 3 << 19

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class CpuKernelError(RuntimeError):
    """The C kernel refused its inputs or ran out of memory or threads."""


_KERNEL = cpu_build.KernelFunction(
    "decode_attention",
    "paged_decode_attention",
    [_INT, _P, _P, _P, _I64, _I64, _I64, _P, _I64, _P, _P, *[_INT] * 6, ctypes.c_float, _INT],
)


_PREFILL_KERNEL = cpu_build.KernelFunction(
    "prefill_attention",
    "paged_prefill_attention",
    [_INT, _P, _I64, _P, _P, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _P, _I64]
    + [_INT] * 6
    + [ctypes.c_float, _INT],
)


def _serves(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    dtype = q.dtype
    if q.device.type != "cpu" or dtype not in _DTYPES:
        return False
    if key_cache.dtype != dtype or value_cache.dtype != dtype:
        return False
    strides = key_cache.stride()
    if strides != value_cache.stride() or strides[3] != 1:
        return False
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = key_cache.shape[2]
    return heads % kv_heads == 0 and heads // kv_heads <= _MAX_GROUP and dim <= _MAX_DIM


def supported(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether `paged_attention_decode_cpu` serves these tensors."""
    return _serves(q, key_cache, value_cache) and _KERNEL.get() is not None


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
    out = paged_attention_decode_if_supported(
        q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window
    )
    if out is None:
        raise CpuKernelError("the CPU decode kernel does not serve these inputs; check supported()")
    return out


def paged_attention_decode_if_supported(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor | None:
    """`paged_attention_decode_cpu(...)`, or None (nothing done) where
    `supported(...)` does not hold: one check per call for callers with a
    torch fallback."""
    kernel = _KERNEL.get()
    if kernel is None or not _serves(q, key_cache, value_cache):
        return None
    check_decode_inputs(q, key_cache, value_cache, block_tables, seq_lens)
    q = q.contiguous()
    tables = block_tables
    if tables.dtype != torch.int64 or tables.stride(1) != 1:
        tables = tables.to(torch.int64).contiguous()
    lens = seq_lens
    if lens.dtype != torch.int64 or lens.stride(0) != 1:
        lens = lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    batch, heads, dim = q.shape
    kv_strides = key_cache.stride()
    status = kernel(
        _DTYPES[q.dtype],
        q.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        kv_strides[0],
        kv_strides[1],
        kv_strides[2],
        tables.data_ptr(),
        tables.stride(0),
        lens.data_ptr(),
        out.data_ptr(),
        batch,
        heads,
        key_cache.shape[2],
        dim,
        key_cache.shape[1],
        sliding_window or 0,
        scale,
        _decode_threads(lens, key_cache, sliding_window),
    )
    if status != 0:
        raise CpuKernelError(
            "the CPU decode kernel failed "
            + ("(shape beyond its limits)" if status == 1 else "(out of memory or threads)")
        )
    return out


def _decode_threads(
    lens: torch.Tensor, key_cache: torch.Tensor, sliding_window: int | None = None
) -> int:
    """Up to torch's thread count, one per `_DECODE_BYTES_PER_THREAD` (or
    part of it) of keys and values the call reads (a window's keys only)."""
    threads = torch.get_num_threads()
    if threads == 1:
        return 1
    keys = lens.clamp(max=sliding_window) if sliding_window else lens
    kv_heads, dim = key_cache.shape[2], key_cache.shape[3]
    read = int(keys.sum()) * kv_heads * dim * 2 * key_cache.element_size()
    return max(1, min(threads, -(-read // max(_DECODE_BYTES_PER_THREAD, 1))))


def _threads_for(work: int) -> int:
    """Up to torch's thread count, one per `_PARALLEL_WORK` of `work` multiply-adds (prefill)."""
    return max(1, min(torch.get_num_threads(), work // max(_PARALLEL_WORK, 1)))


def paged_prefill_attention_if_supported(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    chunks: ChunkRows,
    out: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> bool:
    """Causal attention of the prompt chunks `chunks` describes, over the
    cache (their K/V already written), into their rows of `out`; False
    (nothing written) where the kernel does not serve these tensors.

    q `[T, heads, dim]` with each token's heads side by side (a view of the
    fused QKV projection is read in place); out `[T, heads, dim]` contiguous,
    q's dtype. Token `j` of chunk `i` is row `starts[i] + j`, at position
    `seq_lens[i] - lens[i] + j`.
    """
    kernel = _PREFILL_KERNEL.get()
    if kernel is None or not _serves(q, key_cache, value_cache) or not out.is_contiguous():
        return False
    dim = q.shape[2]
    if q.stride(2) != 1 or q.stride(1) != dim:
        q = q.contiguous()
    kv_strides = key_cache.stride()
    seq_lens = chunks.seq_lens
    status = kernel(
        _DTYPES[q.dtype],
        q.data_ptr(),
        q.stride(0),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        kv_strides[0],
        kv_strides[1],
        kv_strides[2],
        chunks.block_tables.data_ptr(),
        chunks.block_tables.stride(0),
        chunks.starts.data_ptr(),
        chunks.lens.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        seq_lens.shape[0],
        q.shape[1],
        key_cache.shape[2],
        dim,
        key_cache.shape[1],
        sliding_window or 0,
        scale,
        _threads_for(chunks.query_keys * q.shape[1] * dim),
    )
    if status == 2:
        raise CpuKernelError("the CPU prefill attention kernel ran out of memory or threads")
    return status == 0
