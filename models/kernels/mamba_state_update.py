"""One decode step of the Mamba2 selective state space update, in place.

For each sequence `b` (one new token), head `h` of group `g = h // (nheads // ngroups)`:

    dt'   = clamp(softplus(dt[b, h] + dt_bias[h]), dt_min, dt_max)   (softplus optional)
    S     = state[slot[b], h]                          [head_dim, dstate], float32
    S     = S * exp(dt' * A[h]) + dt' * x[b, h, :, None] * B[b, g, None, :]
    y     = S @ C[b, g] + D[h] * x[b, h]               [head_dim]
    y     = y * silu(z[b, h])                          (only when z is given)

`A` is the negative decay per head (`-exp(A_log)`), as Mamba2 stores it after
loading. The state row `state[slot[b]]` is overwritten with the new `S`
(or, with `out_slot_indices`, row `state[out_slot[b]]` is, and the row read
stays as it was: a speculative verify keeps the state after every position); the
slot pool is `[num_slots, nheads, head_dim, dstate]` and may be a strided view
(e.g. one layer of the V2 Mamba buffer). All arithmetic is float32; `y` is
returned in `x`'s dtype. Slots in `slot_indices` must be distinct.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# Head-dim rows per program; the state tile is [_ROWS, next_pow2(dstate)].
_ROWS = 16

DtLimit = tuple[float, float]
NO_DT_LIMIT: DtLimit = (0.0, float("inf"))


class MambaShapeError(ValueError):
    """Inputs of a Mamba state update disagree on shapes."""


def check_update_inputs(
    state: torch.Tensor,
    slot_indices: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    z: torch.Tensor | None,
    out_slot_indices: torch.Tensor | None = None,
) -> None:
    """Raise `MambaShapeError` when the inputs break the module contract."""
    if state.dim() != 4 or x.dim() != 3:
        raise MambaShapeError(
            f"expected state [slots, nheads, head_dim, dstate] and x [B, nheads, head_dim]; "
            f"got {tuple(state.shape)} and {tuple(x.shape)}"
        )
    batch, nheads, head_dim = x.shape
    dstate = state.shape[3]
    if tuple(state.shape[1:3]) != (nheads, head_dim):
        raise MambaShapeError(
            f"state holds {tuple(state.shape[1:3])} (nheads, head_dim) per slot but x has "
            f"{(nheads, head_dim)}"
        )
    if dt.shape != (batch, nheads) or slot_indices.shape != (batch,):
        raise MambaShapeError(
            f"dt must be [{batch}, {nheads}] and slot_indices [{batch}]; got "
            f"{tuple(dt.shape)} and {tuple(slot_indices.shape)}"
        )
    if B.shape != C.shape or B.dim() != 3 or B.shape[0] != batch or B.shape[2] != dstate:
        raise MambaShapeError(
            f"B and C must both be [{batch}, ngroups, {dstate}]; got {tuple(B.shape)} "
            f"and {tuple(C.shape)}"
        )
    if nheads % B.shape[1] != 0:
        raise MambaShapeError(f"nheads {nheads} is not a multiple of ngroups {B.shape[1]}")
    others = [state, slot_indices, dt, B, C] + ([z] if z is not None else [])
    if any(t.device != x.device for t in others):
        raise MambaShapeError(
            f"x is on {x.device} but other inputs are on {[str(t.device) for t in others]}; "
            "move them to one device"
        )
    if z is not None and z.shape != x.shape:
        raise MambaShapeError(f"z must match x {tuple(x.shape)}; got {tuple(z.shape)}")
    if out_slot_indices is not None and out_slot_indices.shape != slot_indices.shape:
        raise MambaShapeError(
            f"out_slot_indices must match slot_indices {tuple(slot_indices.shape)}; got "
            f"{tuple(out_slot_indices.shape)}"
        )


# ---------------------------------------------------------------------------
# Triton kernel: one program per (sequence, head, tile of head_dim rows).
# ---------------------------------------------------------------------------


@triton.jit
def _state_update_kernel(
    state_ptr, slot_ptr, out_slot_ptr, x_ptr, dt_ptr, dt_bias_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, out_ptr,
    dt_min, dt_max,
    stride_sn, stride_sh, stride_sp, stride_ss,
    stride_xb, stride_xh, stride_xp,
    stride_dtb, stride_dth,
    stride_bb, stride_bg, stride_bs,
    stride_cb, stride_cg, stride_cs,
    stride_zb, stride_zh, stride_zp,
    stride_ob, stride_oh, stride_op,
    head_dim, dstate,
    HEADS_PER_GROUP: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, HAS_Z: tl.constexpr,
    ROWS: tl.constexpr, DSTATE_PAD: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    group = head // HEADS_PER_GROUP
    p = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    n = tl.arange(0, DSTATE_PAD)
    p_mask = p < head_dim
    n_mask = n < dstate

    # Slot ids index a pool that can exceed int32 element offsets.
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    s_offs = slot * stride_sn + head * stride_sh + p[:, None] * stride_sp + n[None, :] * stride_ss
    s_mask = p_mask[:, None] & n_mask[None, :]
    s = tl.load(state_ptr + s_offs, mask=s_mask, other=0.0).to(tl.float32)

    x = tl.load(x_ptr + seq * stride_xb + head * stride_xh + p * stride_xp, mask=p_mask, other=0.0)
    x = x.to(tl.float32)
    dt = tl.load(dt_ptr + seq * stride_dtb + head * stride_dth).to(tl.float32)
    dt += tl.load(dt_bias_ptr + head).to(tl.float32)
    if DT_SOFTPLUS:
        # Same threshold as torch's softplus: linear above 20 avoids exp overflow.
        dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    a = tl.load(a_ptr + head).to(tl.float32)

    b_vec = tl.load(
        b_ptr + seq * stride_bb + group * stride_bg + n * stride_bs, mask=n_mask, other=0.0
    )
    c_vec = tl.load(
        c_ptr + seq * stride_cb + group * stride_cg + n * stride_cs, mask=n_mask, other=0.0
    )
    decay = tl.exp(a * dt)
    s = s * decay + (dt * x)[:, None] * b_vec.to(tl.float32)[None, :]
    out_slot = tl.load(out_slot_ptr + seq).to(tl.int64)
    o_offs = s_offs + (out_slot - slot) * stride_sn
    tl.store(state_ptr + o_offs, s.to(state_ptr.dtype.element_ty), mask=s_mask)

    y = tl.sum(s * c_vec.to(tl.float32)[None, :], axis=1)
    y += x * tl.load(d_ptr + head).to(tl.float32)
    if HAS_Z:
        z = tl.load(
            z_ptr + seq * stride_zb + head * stride_zh + p * stride_zp, mask=p_mask, other=0.0
        )
        z = z.to(tl.float32)
        y *= z * tl.sigmoid(z)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + p * stride_op,
        y.to(out_ptr.dtype.element_ty),
        mask=p_mask,
    )


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
    """Triton Mamba2 decode step; updates `state[slot_indices]` in place (or
    writes `state[out_slot_indices]`), returns y.

    See the module docstring for the math and shapes.
    """
    check_update_inputs(state, slot_indices, x, dt, B, C, z, out_slot_indices)
    batch, nheads, head_dim = x.shape
    out = torch.empty_like(x)
    if batch == 0:
        return out
    # Any pointer works for z when absent; HAS_Z=False removes every use of it.
    z_arg = z if z is not None else x
    grid = (batch, nheads, triton.cdiv(head_dim, _ROWS))
    _state_update_kernel[grid](
        state, slot_indices, slot_indices if out_slot_indices is None else out_slot_indices,
        x, dt, dt_bias, A, B, C, D, z_arg, out,
        float(dt_limit[0]), float(dt_limit[1]),
        *state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(),
        *z_arg.stride(), *out.stride(),
        head_dim, state.shape[3],
        HEADS_PER_GROUP=nheads // B.shape[1],
        DT_SOFTPLUS=dt_softplus, HAS_Z=z is not None,
        ROWS=_ROWS, DSTATE_PAD=triton.next_power_of_2(state.shape[3]),
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------
# Plain-torch twin
# ---------------------------------------------------------------------------


def mamba_state_update_ref(
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
    """Reference for `mamba_state_update`, in float32 torch ops."""
    check_update_inputs(state, slot_indices, x, dt, B, C, z, out_slot_indices)
    heads_per_group = x.shape[1] // B.shape[1]
    slots = slot_indices.long()
    xf = x.float()
    step = dt.float() + dt_bias.float()
    if dt_softplus:
        step = F.softplus(step)
    step = step.clamp(dt_limit[0], dt_limit[1])[:, :, None, None]  # [B, h, 1, 1]
    # Head h reads group h // heads_per_group: repeat each group's row that many times.
    b_heads = B.float().repeat_interleave(heads_per_group, dim=1)[:, :, None, :]
    c_heads = C.float().repeat_interleave(heads_per_group, dim=1)
    decay = torch.exp(step * A.float()[None, :, None, None])
    new_state = state[slots].float() * decay + step * xf[..., None] * b_heads
    written = slots if out_slot_indices is None else out_slot_indices.long()
    state.index_copy_(0, written, new_state.to(state.dtype))
    y = torch.einsum("bhpn,bhn->bhp", new_state, c_heads) + xf * D.float()[None, :, None]
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)
