"""RMSNorm on CPU through the C kernel in `csrc/rms_norm.c`, optionally fused
with the residual add before it, and Mamba2's gated grouped RMSNorm
(`gated_rms_norm`; its torch twin `gated_rms_norm_ref`).

In torch an RMSNorm is a chain of small ops (upcast, square, mean, rsqrt,
scale, downcast, weight) and the residual add one more; a decode step runs
two of each per layer on a few rows. The kernel does each row in one pass
with the same rounding (see the C file's header). `supported(...)` says
whether tensors can take this path (one CPU dtype, fp32 or bf16, rows
contiguous, no autograd, the library built); otherwise callers run torch.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from models.kernels import cpu_build

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_MAX_WIDTH = 16384
# Below this many elements one thread is faster than starting more.
_PARALLEL_ELEMENTS = 1 << 18

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class NormKernelError(RuntimeError):
    """The RMSNorm kernel refused its inputs."""


_KERNEL = cpu_build.KernelFunction(
    "rms_norm",
    "rms_norm",
    [_INT, _P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, ctypes.c_float, _INT],
)


_GATED_KERNEL = cpu_build.KernelFunction(
    "rms_norm",
    "gated_rms_norm",
    [_INT, _P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, ctypes.c_float, _INT],
)


def supported(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether `rms_norm(x, weight, eps, residual)` can run the C kernel."""
    if not x.is_cpu or x.dtype not in _DTYPES or x.dim() != 2:
        return False
    width = x.shape[1]
    if weight.dtype != x.dtype or weight.shape != (width,) or width > _MAX_WIDTH:
        return False
    if x.stride(1) != 1 or weight.stride(0) != 1:
        return False
    if residual is not None and (
        residual.dtype != x.dtype or residual.shape != x.shape or residual.stride(1) != 1
    ):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False  # the kernel records no autograd graph
    return _KERNEL.get() is not None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """`weight * norm(x)` of 2-D `x`; with `residual`, first `residual += x`
    (in place) and normalize that. Only where `supported(...)` holds."""
    out = rms_norm_if_supported(x, weight, eps, residual)
    if out is None:
        raise NormKernelError("the RMSNorm kernel does not serve these inputs; check supported()")
    return out


def rms_norm_if_supported(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | None:
    """`rms_norm(...)`, or None (nothing done) where `supported(...)` does not hold:
    one check per call for callers with a torch fallback."""
    kernel = _KERNEL.get()
    if kernel is None or not supported(x, weight, residual):
        return None
    rows, width = x.shape
    out = torch.empty(rows, width, dtype=x.dtype)
    kernel(
        _DTYPES[x.dtype],
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        weight.data_ptr(),
        out.data_ptr(),
        width,
        rows,
        width,
        eps,
        torch.get_num_threads() if rows * width >= _PARALLEL_ELEMENTS else 1,
    )
    return out


def gated_rms_norm_ref(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group: int, eps: float
) -> torch.Tensor:
    """RMSNorm of `x * silu(z)` over groups of `group` channels of the last dim,
    in float32, cast to `x`'s dtype, then times `weight` (transformers' gated
    Mamba norm with `norm_before_gate=False`), in `z`'s dtype. The mixer's x
    is its float32 scan output, so only the result is rounded to the model
    dtype."""
    h = x.float() * F.silu(z.float())
    groups = h.view(*h.shape[:-1], -1, group)
    groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * groups.view_as(h).to(x.dtype)).to(z.dtype)


def gated_rms_norm_if_supported(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group: int, eps: float
) -> torch.Tensor | None:
    """`gated_rms_norm_ref(...)` through the C kernel: `x` `[T, width]` float32,
    `z` of the same shape in fp32 or bf16 (rows may be strided), `weight` of
    z's dtype; None (nothing done) where the tensors do not fit it."""
    kernel = _GATED_KERNEL.get()
    if kernel is None or x.dim() != 2 or z.shape != x.shape or not x.is_cpu or not z.is_cpu:
        return None
    rows, width = x.shape
    if x.dtype != torch.float32 or z.dtype not in _DTYPES or weight.dtype != z.dtype:
        return None
    if weight.shape != (width,) or width > _MAX_WIDTH or group < 1 or width % group:
        return None
    if x.stride(1) != 1 or z.stride(1) != 1 or weight.stride(0) != 1:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or z.requires_grad or weight.requires_grad):
        return None
    out = torch.empty(rows, width, dtype=z.dtype)
    failed = kernel(
        _DTYPES[z.dtype],
        x.data_ptr(),
        x.stride(0),
        z.data_ptr(),
        z.stride(0),
        weight.data_ptr(),
        out.data_ptr(),
        width,
        rows,
        width,
        group,
        eps,
        torch.get_num_threads() if rows * width >= _PARALLEL_ELEMENTS else 1,
    )
    return None if failed else out
