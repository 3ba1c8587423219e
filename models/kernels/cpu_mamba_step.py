"""A Mamba2 layer's decode step and prompt chunks on CPU through the C
kernel in `csrc/mamba_step.c`: the conv shift, SiLU and selective state
update of every sequence of the step in one call, the states rewritten in
place (or, for a decode step, written to `out_slots`, a speculative
verify's scratch slots). A prompt chunk runs its tokens one after another,
the recurrence itself (`mamba_scan_if_supported`); its torch path is the
chunked scan of `models.layers.ssd`, which does more arithmetic in many
more ops.

torch runs this as about twenty ops, several of them full passes over the
`[b, H, P, N]` state (gather, decay, outer product, sum, scatter back); the
kernel reads and writes each state row once. `mamba_step_ref` is the
plain-torch twin: the conv step of `models.layers.mamba2` and the state
update of `models.kernels.mamba_state_update`. `supported(...)` says whether
tensors can take the kernel (fp32 throughout, unit stride along the state
and the conv input, no autograd, the library built); otherwise callers run
the twin.

Shapes (b sequences, H heads of P, G groups of state size N, conv kernel K):

    xbc        [b, H * P + 2 * G * N]   rows may be strided (in_proj's columns)
    dt_raw     [b, H]                   before dt_bias and softplus
    conv_state [slots, H * P + 2 * G * N, K - 1]
    ssm_state  [slots, H, P, N]
    -> y       [b, H, P] float32, D skip included
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.kernels import cpu_build
from models.kernels.mamba_state_update import DtLimit, mamba_state_update_ref

# Below this many state values one thread is faster than starting more.
_PARALLEL_STATE = 1 << 14

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float

_KERNEL = cpu_build.KernelFunction(
    "mamba_step",
    "mamba_step",
    [_P, _I64, _P, _I64]
    + [_P, _I64, _I64, _I64, _P, _P]
    + [_P, _I64, _I64, _I64, _P, _P, _P, _P]
    + [_P, _P, _P, _F, _F, _P]
    + [_I64] * 6
    + [_INT],
)


class MambaStepError(RuntimeError):
    """The Mamba step kernel refused its inputs."""


@dataclass(frozen=True)
class MambaStepWeights:
    """A Mamba2 layer's tensors the step reads besides its inputs and states:
    the depthwise conv `[C, K]` and its bias, dt's bias, A (negative), the D
    skip, the B/C group count and dt's clamp."""

    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    dt_bias: torch.Tensor
    A: torch.Tensor
    D: torch.Tensor
    n_groups: int
    dt_limit: DtLimit


def supported(
    xbc: torch.Tensor,
    dt_raw: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    conv_weight: torch.Tensor,
) -> bool:
    """Whether the kernel can run on these tensors (and is built)."""
    tensors = (xbc, dt_raw, conv_state, ssm_state, conv_weight)
    if any(not t.is_cpu or t.dtype != torch.float32 for t in tensors):
        return False
    if xbc.dim() != 2 or xbc.stride(1) != 1 or dt_raw.dim() != 2 or dt_raw.stride(1) != 1:
        return False
    if ssm_state.dim() != 4 or ssm_state.stride(3) != 1 or conv_state.dim() != 3:
        return False
    if not conv_weight.is_contiguous() or conv_weight.shape[0] != xbc.shape[1]:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (xbc, dt_raw, conv_weight)):
        return False  # the kernel records no autograd graph
    return _KERNEL.get() is not None


def mamba_step_if_supported(
    xbc: torch.Tensor,
    dt_raw: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    weights: MambaStepWeights,
    out_slots: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One decode step (row b of `xbc` is sequence b's token): y `[b, H, P]`
    float32, states updated (or written to `out_slots`); None (nothing done)
    where `supported(...)` does not hold or the kernel refuses the shape."""
    if not supported(xbc, dt_raw, conv_state, ssm_state, weights.conv_weight):
        return None
    _, heads, head_dim, dstate = ssm_state.shape
    y = torch.empty(xbc.shape[0], heads, head_dim)
    written = slots if out_slots is None else out_slots
    ok = _launch(xbc, dt_raw, conv_state, ssm_state, slots, written, None, weights, y)
    return y if ok else None


def mamba_scan_if_supported(
    xbc: torch.Tensor,
    dt_raw: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: Sequence[int],
    rows: Sequence[tuple[int, int]],
    weights: MambaStepWeights,
    y: torch.Tensor,
) -> bool:
    """Prompt chunks: sequence i's tokens are the rows `rows[i]` = (begin,
    end) of `xbc` and `dt_raw`, run one after another from the states in
    `slots[i]`, which end as the last token left them; their y rows of
    `y` `[T, H, P]` (float32, contiguous) are written. False (nothing done)
    where the kernel does not serve the tensors."""
    if not supported(xbc, dt_raw, conv_state, ssm_state, weights.conv_weight):
        return False
    if y.dtype != torch.float32 or not y.is_contiguous():
        return False
    index = torch.tensor(list(slots), dtype=torch.int64)
    bounds = torch.tensor(list(rows), dtype=torch.int64).reshape(-1, 2)
    return _launch(xbc, dt_raw, conv_state, ssm_state, index, index, bounds, weights, y)


def _launch(
    xbc: torch.Tensor,
    dt_raw: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    out_slots: torch.Tensor,
    bounds: torch.Tensor | None,
    weights: MambaStepWeights,
    y: torch.Tensor,
) -> bool:
    kernel = _KERNEL.get()
    batch = slots.shape[0]
    if kernel is None:
        return False
    if batch == 0:
        return True
    _, heads, head_dim, dstate = ssm_state.shape
    slots = slots.to(torch.int64).contiguous()
    out_slots = out_slots.to(torch.int64).contiguous()
    begin = end = None
    tokens = batch
    if bounds is not None:
        begin, end = bounds[:, 0].contiguous(), bounds[:, 1].contiguous()
        tokens = int((end - begin).sum())
    small = [t.float().contiguous() for t in (weights.dt_bias, weights.A, weights.D)]
    bias = weights.conv_bias
    bias = None if bias is None else bias.float().contiguous()
    work = tokens * heads * head_dim * dstate
    threads = torch.get_num_threads() if work >= _PARALLEL_STATE else 1
    conv_weight = weights.conv_weight
    failed = kernel(
        xbc.data_ptr(), xbc.stride(0), dt_raw.data_ptr(), dt_raw.stride(0),
        conv_state.data_ptr(), *conv_state.stride(), conv_weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        ssm_state.data_ptr(), *ssm_state.stride()[:3], slots.data_ptr(), out_slots.data_ptr(),
        None if begin is None else begin.data_ptr(), None if end is None else end.data_ptr(),
        *(t.data_ptr() for t in small), float(weights.dt_limit[0]), float(weights.dt_limit[1]),
        y.data_ptr(), batch, heads, head_dim, weights.n_groups, dstate, conv_weight.shape[1],
        threads,
    )  # fmt: skip
    return not failed


def mamba_step(*args: object, **kwargs: object) -> torch.Tensor:
    """`mamba_step_if_supported(...)` that raises `MambaStepError` where the
    kernel does not serve the inputs (for tests and benchmarks)."""
    y = mamba_step_if_supported(*args, **kwargs)  # type: ignore[arg-type]
    if y is None:
        raise MambaStepError("the Mamba step kernel does not serve these inputs; check supported()")
    return y


def causal_conv_step_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """One conv step for b sequences: x `[b, D]`; reads `conv_state[slots]` and
    rewrites it (or writes `conv_state[out_slots]`, leaving the read rows);
    returns the conv output `[b, D]` before the activation."""
    window = torch.cat([conv_state[slots].to(x.dtype), x[:, :, None]], dim=-1)  # [b, D, K]
    conv_state[slots if out_slots is None else out_slots] = window[:, :, 1:].to(conv_state.dtype)
    out = (window * weight).sum(-1)
    return out + bias if bias is not None else out


def mamba_step_ref(
    xbc: torch.Tensor,
    dt_raw: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    weights: MambaStepWeights,
    out_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch twin of `mamba_step_if_supported` (any dtype, any device)."""
    _, heads, head_dim, dstate = ssm_state.shape
    groups = weights.n_groups
    conv = causal_conv_step_ref(
        xbc, conv_state, slots, weights.conv_weight, weights.conv_bias, out_slots
    )
    x, B, C = F.silu(conv).split([heads * head_dim, groups * dstate, groups * dstate], -1)
    shape = (xbc.shape[0], groups, dstate)
    return mamba_state_update_ref(
        ssm_state,
        slots,
        x.reshape(-1, heads, head_dim),
        dt_raw,
        weights.dt_bias,
        weights.A,
        B.reshape(shape),
        C.reshape(shape),
        weights.D,
        dt_limit=weights.dt_limit,
        out_slot_indices=out_slots,
    ).float()
