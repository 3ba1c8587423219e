"""The one place that picks a Triton kernel or its plain-torch twin.

Models and the transfer code call these functions, never the kernel modules:

- tensors on CUDA run the Triton kernel;
- tensors on CPU run the reference, unless `DISAGG_FORCE_TRITON=1`, which runs
  the kernel anyway. On CPU that only works under the Triton interpreter
  (`TRITON_INTERPRET=1` set before the kernel modules are imported), which is
  how the test suite checks kernels on machines without a GPU.
- decode attention, RMSNorm, the rotary + K/V cache write, SwiGLU's
  activation, a Mamba2 layer's decode step and a MoE layer's experts on CPU
  tensors also have C kernels (`cpu_attention`, `cpu_norm`, `cpu_rope`,
  `cpu_silu_mul`, `cpu_mamba_step`, `cpu_moe_experts`, built on first use);
  `cpu_decode_attention`, `rms_norm`, `cpu_rope_and_cache`, `silu_mul`,
  `cpu_mamba_decode_step` and `moe_experts` run them where they serve a
  call.

Each function has the signature of its reference twin.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from triton.runtime.interpreter import InterpretedFunction

from models.batch import ChunkRows
from models.kernels import (
    block_copy,
    cpu_attention,
    cpu_build,
    cpu_mamba_step,
    cpu_moe_experts,
    cpu_norm,
    cpu_rope,
    cpu_silu_mul,
    paged_attention,
)
from models.kernels import mamba_state_update as mamba_kernel
from models.kernels.block_copy import BlockIds
from models.kernels.mamba_state_update import NO_DT_LIMIT, DtLimit

FORCE_TRITON_ENV = "DISAGG_FORCE_TRITON"
# Past this many rows an expert on average (tokens x top_k / experts), one
# MKL product per expert beats the MoE kernel: at hidden 1024, 32 experts of
# 512, top-6, shared 1024, fp32 on 2 cores, the kernel took 64 against 68 ms
# at 384 tokens (72 rows an expert), 84 against 83-85 at 512 (96) and 166
# against 140 at 1024 (192); rerun with
# `python -m benchmarks.moe_bench --decode --prefill 384 512 1024 --layers 2`.
MOE_KERNEL_MAX_ROWS = 96


class KernelUnavailableError(RuntimeError):
    """A Triton kernel was requested where it cannot run."""


def kernels_interpreted() -> bool:
    """True when the kernels were built for the Triton interpreter (CPU execution)."""
    kernels = (
        paged_attention._paged_decode_kernel,
        mamba_kernel._state_update_kernel,
        block_copy._copy_rows_kernel,
    )
    return all(isinstance(kernel, InterpretedFunction) for kernel in kernels)


@functools.cache
def triton_forced() -> bool:
    """Whether `DISAGG_FORCE_TRITON=1` asks for the kernels on CPU tensors.

    Read once per process: every kernel call of every step asks.
    """
    return os.environ.get(FORCE_TRITON_ENV, "0") == "1"


def reread_kernel_switches() -> None:
    """Read `DISAGG_FORCE_TRITON` and `DISAGG_CPU_KERNELS` again at their next
    use: for tests that change them within one process."""
    triton_forced.cache_clear()
    cpu_build.enabled.cache_clear()


def use_triton(device: torch.device) -> bool:
    """Whether calls with tensors on `device` run the Triton kernel.

    Raises `KernelUnavailableError` when `DISAGG_FORCE_TRITON=1` asks for the
    kernel on a CPU tensor but the interpreter is off.
    """
    if device.type == "cuda":
        return True
    if not triton_forced():
        return False
    if not kernels_interpreted():
        raise KernelUnavailableError(
            f"{FORCE_TRITON_ENV}=1 runs Triton kernels on {device.type} tensors only under the "
            "interpreter; set TRITON_INTERPRET=1 before importing models.kernels, or unset "
            f"{FORCE_TRITON_ENV} to use the reference implementations"
        )
    return True


def paged_attention_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over the paged cache; see `models.kernels.paged_attention`."""
    impl = (
        paged_attention.paged_attention_decode
        if use_triton(q.device)
        else paged_attention.paged_attention_decode_ref
    )
    return impl(q, key_cache, value_cache, block_tables, seq_lens, scale, out)


def _cpu_kernels_apply(t: torch.Tensor) -> bool:
    """Whether a C kernel may serve `t`: a CPU tensor, Triton not forced."""
    return t.device.type == "cpu" and not triton_forced()


def cpu_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor | None:
    """Decode attention through the C kernel on CPU tensors it serves; None
    (nothing done) elsewhere, for the caller's torch path."""
    if not _cpu_kernels_apply(q):
        return None
    return cpu_attention.paged_attention_decode_if_supported(
        q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window
    )


def cpu_prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    chunks: ChunkRows,
    out: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> bool:
    """Causal attention of a step's prompt chunks into their rows of `out`
    through the C kernel on CPU tensors it serves; False (nothing written)
    elsewhere, for the caller's other path."""
    if not _cpu_kernels_apply(q):
        return False
    return cpu_attention.paged_prefill_attention_if_supported(
        q, key_cache, value_cache, chunks, out, scale, sliding_window
    )


def cpu_rope_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
) -> bool:
    """Rotate Q/K of a fused QKV output in place and store K/V through the C
    kernel on CPU tensors it serves: True; False (nothing done) elsewhere."""
    if not _cpu_kernels_apply(qkv):
        return False
    return cpu_rope.rope_and_cache_if_supported(
        qkv, cos, sin, num_heads, key_cache, value_cache, slot_mapping, block_size
    )


def moe_experts(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    shared: cpu_moe_experts.SharedExpert | None = None,
) -> torch.Tensor:
    """A MoE layer's routed experts (and shared expert), in `x`'s dtype: the C
    kernel on CPU tensors it serves, up to `MOE_KERNEL_MAX_ROWS` rows an
    expert on average; else the torch twin (`cpu_moe_experts.moe_experts_ref`)."""
    if _cpu_kernels_apply(x) and experts.numel() <= MOE_KERNEL_MAX_ROWS * up.shape[0]:
        out = cpu_moe_experts.moe_experts_if_supported(x, experts, weights, up, down, shared)
        if out is not None:
            return out
    return cpu_moe_experts.moe_experts_ref(x, experts, weights, up, down, shared)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`weight * norm(x)` over the last dim; with `residual`, first `residual += x`
    (in place) and normalize that. The C kernel on CPU where it applies, else torch."""
    if _cpu_kernels_apply(x):
        out = cpu_norm.rms_norm_if_supported(x, weight, eps, residual)
        if out is not None:
            return out
    if residual is not None:
        residual.add_(x)
        x = residual
    # One fused kernel for the statistic and scaling; on bf16/fp16 input it
    # accumulates in float32 and rounds once to the input dtype, as the
    # reference models' explicit float32 round trip does. Then the weight.
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group: int, eps: float
) -> torch.Tensor:
    """Mamba2's gated grouped RMSNorm of float32 `x` gated by `z`
    (`cpu_norm.gated_rms_norm_ref`). The C kernel on CPU where it applies,
    else torch."""
    if _cpu_kernels_apply(z):
        out = cpu_norm.gated_rms_norm_if_supported(x, z, weight, group, eps)
        if out is not None:
            return out
    return cpu_norm.gated_rms_norm_ref(x, z, weight, group, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of `gate_up = [gate | up]` along the last dim. The C
    kernel on CPU where it applies, else torch (`silu_mul_ref`)."""
    if _cpu_kernels_apply(gate_up):
        out = cpu_silu_mul.silu_mul_if_supported(gate_up)
        if out is not None:
            return out
    return silu_mul_ref(gate_up)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    # In place into silu's fresh output: one `[T, intermediate]` buffer less.
    return F.silu(gate).mul_(up)


def mamba_state_update(
    state: torch.Tensor,
    slot_indices: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    z: torch.Tensor | None = None,
    dt_limit: DtLimit = NO_DT_LIMIT,
    dt_softplus: bool = True,
    out_slot_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mamba2 decode step, state updated in place (or written to
    `out_slot_indices`); see `models.kernels.mamba_state_update`."""
    impl = (
        mamba_kernel.mamba_state_update
        if use_triton(x.device)
        else mamba_kernel.mamba_state_update_ref
    )
    return impl(
        state, slot_indices, x, dt, dt_bias, A, B, C, D, z, dt_limit, dt_softplus, out_slot_indices
    )


def cpu_mamba_decode_step(
    xbc: torch.Tensor,
    dt_raw: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    weights: cpu_mamba_step.MambaStepWeights,
    out_slots: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """A Mamba2 layer's decode step (conv shift, SiLU, state update) through
    the C kernel on CPU tensors it serves: y `[b, H, P]` float32; None
    (nothing done) elsewhere, for the caller's conv step and
    `mamba_state_update`. See `models.kernels.cpu_mamba_step`."""
    if not _cpu_kernels_apply(xbc):
        return None
    return cpu_mamba_step.mamba_step_if_supported(
        xbc, dt_raw, conv_state, ssm_state, slots, weights, out_slots
    )


def cpu_mamba_chunk_scan(
    xbc: torch.Tensor,
    dt_raw: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: Sequence[int],
    rows: Sequence[tuple[int, int]],
    weights: cpu_mamba_step.MambaStepWeights,
    y: torch.Tensor,
) -> bool:
    """Prompt chunks of a Mamba2 layer (sequence i: rows `rows[i]`, state
    slot `slots[i]`) through the C kernel, y rows written into `y`; False
    (nothing done) where it does not serve the tensors, for the caller's
    chunked scan (`models.layers.ssd`). See `models.kernels.cpu_mamba_step`."""
    if not _cpu_kernels_apply(xbc):
        return False
    return cpu_mamba_step.mamba_scan_if_supported(
        xbc, dt_raw, conv_state, ssm_state, slots, rows, weights, y
    )


def gather_blocks(
    pool: torch.Tensor, block_ids: BlockIds, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`pool[block_ids]` into contiguous staging; see `models.kernels.block_copy`."""
    impl = block_copy.gather_blocks if use_triton(pool.device) else block_copy.gather_blocks_ref
    return impl(pool, block_ids, out)


def scatter_blocks(pool: torch.Tensor, block_ids: BlockIds, staging: torch.Tensor) -> None:
    """Staging rows into `pool[block_ids]`, in place; see `models.kernels.block_copy`."""
    impl = block_copy.scatter_blocks if use_triton(pool.device) else block_copy.scatter_blocks_ref
    impl(pool, block_ids, staging)


def copy_blocks(src: torch.Tensor, src_ids: BlockIds, dst: torch.Tensor, dst_ids: BlockIds) -> None:
    """`dst[dst_ids[i]] = src[src_ids[i]]`, e.g. V1 layer <-> V2 layer view; see `block_copy`."""
    impl = block_copy.copy_blocks if use_triton(dst.device) else block_copy.copy_blocks_ref
    impl(src, src_ids, dst, dst_ids)
