"""Rotary embedding of Q/K and the K/V cache write on CPU, through the C
kernel in `csrc/rope_cache.c`: one pass per token over the fused QKV output
instead of torch's slicing, negation, concatenation, products and two
indexed writes per layer. `supported(...)` says whether tensors can take this
path (one CPU dtype, fp32 or bf16, head dims contiguous, no autograd, the
library built); otherwise callers run torch.
"""

from __future__ import annotations

import ctypes

import torch

from models.kernels import cpu_build

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_MAX_ROT_DIM = 1024
# Below this many tokens one thread is faster than starting more.
_PARALLEL_TOKENS = 256

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class RopeKernelError(RuntimeError):
    """The rotary/cache kernel refused its inputs."""


_KERNEL = cpu_build.KernelFunction(
    "rope_cache",
    "rope_and_cache",
    [_INT, _P, _I64, _INT, _INT, _INT, _INT, _INT, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _P]
    + [_INT, _INT],
)


def supported(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
) -> bool:
    """Whether `rope_and_cache` serves these tensors (see the module docstring)."""
    if qkv.device.type != "cpu" or qkv.dtype not in _DTYPES or qkv.dim() != 3:
        return False
    # Spelled out rather than a generator over the four: this runs per layer.
    dtype = qkv.dtype
    if not (cos.dtype == sin.dtype == key_cache.dtype == value_cache.dtype == dtype):
        return False
    if not (cos.is_cpu and sin.is_cpu and key_cache.is_cpu and value_cache.is_cpu):
        return False
    tokens, _, dim = qkv.shape
    if qkv.stride(2) != 1 or qkv.stride(1) != dim or key_cache.stride() != value_cache.stride():
        return False
    if key_cache.stride(3) != 1 or key_cache.shape[3] != dim:
        return False
    if cos.shape != sin.shape or cos.shape[0] != tokens or cos.stride() != sin.stride():
        return False
    if cos.stride(1) != 1 or cos.shape[1] % 2 or cos.shape[1] > min(dim, _MAX_ROT_DIM):
        return False
    if torch.is_grad_enabled() and qkv.requires_grad:
        return False  # the kernel records no autograd graph
    return _KERNEL.get() is not None


def rope_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
) -> None:
    """Rotate Q/K heads of `qkv` `[T, heads + 2 * kv_heads, dim]` in place by
    `cos`/`sin` `[T, rot_dim]`, then store K and V at `slot_mapping`.
    Only where `supported(...)` holds."""
    done = rope_and_cache_if_supported(
        qkv, cos, sin, num_heads, key_cache, value_cache, slot_mapping, block_size
    )
    if not done:
        raise RopeKernelError("the rotary/cache kernel does not serve these inputs")


def rope_and_cache_if_supported(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
) -> bool:
    """`rope_and_cache(...)` and True, or False (nothing done) where
    `supported(...)` does not hold: one check per call for callers with a
    torch fallback."""
    kernel = _KERNEL.get()
    if kernel is None or not supported(qkv, cos, sin, key_cache, value_cache):
        return False
    tokens, total_heads, dim = qkv.shape
    kv_heads = key_cache.shape[2]
    if total_heads != num_heads + 2 * kv_heads or slot_mapping.shape != (tokens,):
        raise RopeKernelError(
            f"qkv has {total_heads} heads for {num_heads} query and {kv_heads} kv heads, "
            f"slot_mapping {tuple(slot_mapping.shape)} for {tokens} tokens"
        )
    slots = slot_mapping.to(torch.int64).contiguous()
    status = kernel(
        _DTYPES[qkv.dtype],
        qkv.data_ptr(),
        qkv.stride(0),
        tokens,
        num_heads,
        kv_heads,
        dim,
        cos.shape[1],
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        slots.data_ptr(),
        block_size,
        torch.get_num_threads() if tokens >= _PARALLEL_TOKENS else 1,
    )
    if status != 0:
        raise RopeKernelError(f"the rotary/cache kernel refused rot_dim {cos.shape[1]}")
    return True
