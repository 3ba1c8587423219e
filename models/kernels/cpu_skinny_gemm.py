"""The fp32 product of a few rows with a row-major weight on CPU, through the
C kernel in `csrc/skinny_gemm.c`: `x @ weight.T (+ bias)` for up to
`MAX_ROWS` rows, each weight row read once for all of them.

A decode step of a few sequences streams every weight of the model from
memory for a few rows of input; neither torch's BLAS on the row-major
weight nor oneDNN's blocked copy reads it at the rate one core can (on an
AMD EPYC Zen 4 oneDNN's one-row product streamed SmolLM2-135M's weights at
half the rate one thread sums memory, this kernel at about 60% of it). Past
4 rows the kernel multiplies a pair of weight rows by groups of input rows
and prefetches the next pair meanwhile, which on an AMD EPYC Zen 2 beat
oneDNN's blocked copy up to 24 rows (docs/performance.md, "Few-row
products"; see `csrc/skinny_gemm.c`). Which path a model's products take at each row
count is measured when it loads (`models.layers.small_products`).
`supported(...)` says whether tensors can take this path (fp32 CPU
tensors, rows of x, weight and bias contiguous, no autograd, the library
built); otherwise callers run another path.
"""

from __future__ import annotations

import ctypes

import torch

from models.kernels import cpu_build

MAX_ROWS = 32
# Below this many weight values one thread is faster than starting more.
_PARALLEL_WEIGHTS = 1 << 16
# Output rows per claimed chunk: each thread takes about this many chunks.
_CHUNKS_PER_THREAD = 4
_MIN_CHUNK = 8

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class SkinnyGemmError(RuntimeError):
    """The few-row product kernel refused its inputs."""


_KERNEL = cpu_build.KernelFunction(
    "skinny_gemm", "skinny_gemm", [_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _INT]
)


def available() -> bool:
    """Whether the kernel library can be had on this machine (built, not turned off)."""
    return _KERNEL.get() is not None


def supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `skinny_gemm(x, weight, bias)` can run the C kernel."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() != 2:
        return False
    if not (x.is_cpu and weight.is_cpu) or weight.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        return False
    if x.shape[1] != weight.shape[1] or x.stride(1) != 1 or weight.stride(1) != 1:
        return False
    if bias is not None and (
        bias.dtype != torch.float32 or bias.shape != (weight.shape[0],) or bias.stride(0) != 1
    ):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False  # the kernel records no autograd graph
    return _KERNEL.get() is not None


def skinny_gemm_if_supported(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` of 2-D `x` (`[rows, k]` -> `[rows, n]`), or
    None (nothing done) where `supported(...)` does not hold."""
    kernel = _KERNEL.get()
    if kernel is None or not supported(x, weight, bias):
        return None
    rows, k = x.shape
    n = weight.shape[0]
    y = torch.empty(rows, n, dtype=torch.float32)
    threads = torch.get_num_threads() if n * k >= _PARALLEL_WEIGHTS else 1
    # Whole multiples of the kernel's widest tile (8 weight rows).
    chunk = max(_MIN_CHUNK, n // (threads * _CHUNKS_PER_THREAD) // _MIN_CHUNK * _MIN_CHUNK)
    status = kernel(
        x.data_ptr(),
        x.stride(0),
        weight.data_ptr(),
        weight.stride(0),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        y.stride(0),
        rows,
        n,
        k,
        chunk,
        threads,
    )
    if status != 0:
        raise SkinnyGemmError(
            "the few-row product kernel failed "
            + ("(more rows than it takes)" if status == 1 else "(threads)")
        )
    return y
