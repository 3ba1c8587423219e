"""SwiGLU's `silu(gate) * up` on CPU through the C kernel in
`csrc/silu_mul.c`, over the fused gate/up product's output in one pass
(torch runs silu into a new buffer, then multiplies it in place: two passes
over the intermediate width per layer). `supported(...)` says whether a
tensor can take this path (one CPU dtype, fp32 or bf16, 2-D, rows
contiguous, no autograd, the library built); otherwise callers run torch.
"""

from __future__ import annotations

import ctypes

import torch

from models.kernels import cpu_build

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Below this many output values one thread is faster than starting more.
_PARALLEL_ELEMENTS = 1 << 15

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int

_KERNEL = cpu_build.KernelFunction(
    "silu_mul", "silu_mul", [_INT, _P, _I64, _P, _I64, _I64, _I64, _INT]
)


def supported(gate_up: torch.Tensor) -> bool:
    """Whether `silu_mul(gate_up)` can run the C kernel."""
    if not gate_up.is_cpu or gate_up.dtype not in _DTYPES or gate_up.dim() != 2:
        return False
    if gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        return False
    if torch.is_grad_enabled() and gate_up.requires_grad:
        return False  # the kernel records no autograd graph
    return _KERNEL.get() is not None


def silu_mul_if_supported(gate_up: torch.Tensor) -> torch.Tensor | None:
    """`silu(gate) * up` of `gate_up = [gate | up]` (`[rows, 2 * n]` ->
    `[rows, n]`), or None (nothing done) where `supported(...)` does not
    hold: one check per call for callers with a torch fallback."""
    kernel = _KERNEL.get()
    if kernel is None or not supported(gate_up):
        return None
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype)
    kernel(
        _DTYPES[gate_up.dtype],
        gate_up.data_ptr(),
        gate_up.stride(0),
        out.data_ptr(),
        width,
        rows,
        width,
        torch.get_num_threads() if rows * width >= _PARALLEL_ELEMENTS else 1,
    )
    return out
