"""Mamba2 state-space duality (SSD): the chunked prefill scan.

It computes the selective recurrence, per head h, over the tokens t of one
sequence (dt already discretized: softplus + clamp):

    state_t = exp(dt_t * A_h) * state_{t-1} + dt_t * x_t (outer) B_t     # [P, N]
    y_t     = state_t @ C_t                                              # [P]

`ssd_chunked_scan` evaluates it for a whole prompt chunk at once, in blocks of
`chunk_size` tokens: inside a block the recurrence is a masked, decayed
"attention" of C against B; across blocks only the `[H, P, N]` state is
carried. The one-token decode step of the same recurrence is
`models.kernels.dispatch.mamba_state_update`.

The D skip connection (`y += D * x`) is not part of the scan; the mixer adds
it. All math runs in float32.

Shapes: H heads, P head_dim, G groups (heads share B/C within a group),
N state_size, L tokens, Q chunk_size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expand_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`[..., G, N]` -> `[..., H, N]`: each group's B or C serves `H // G` heads."""
    groups = t.shape[-2]
    return t.repeat_interleave(num_heads // groups, dim=-2)


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """`[..., Q]` -> `[..., Q, Q]`: `out[l, s] = a[s+1] + ... + a[l]` for l >= s, else -inf.

    Built from a masked cumulative sum rather than a difference of prefix sums
    so that long chunks do not lose precision to cancellation.
    """
    q = a.shape[-1]
    strict_lower = torch.tril(torch.ones(q, q, dtype=torch.bool, device=a.device), diagonal=-1)
    lower = torch.tril(torch.ones(q, q, dtype=torch.bool, device=a.device), diagonal=0)
    expanded = a[..., None].expand(*a.shape, q).masked_fill(~strict_lower, 0.0)
    return torch.cumsum(expanded, dim=-2).masked_fill(~lower, float("-inf"))


def ssd_chunked_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the recurrence over one sequence's new tokens.

    Args:
        x: `[L, H, P]` inputs.
        dt: `[L, H]` discretized time steps (after softplus and clamping).
        A: `[H]` negative decay rates.
        B, C: `[L, G, N]` input and output projections.
        chunk_size: tokens per block; any L is accepted (the tail is zero-padded).
        initial_state: `[H, P, N]` state before the first token (a continued
            sequence); None means all zeros.

    Returns:
        `(y [L, H, P] float32, final_state [H, P, N] float32)`; the final state is
        the state after the last real token (padding has dt = 0 and leaves it
        unchanged).
    """
    length, num_heads, head_dim = x.shape
    state_size = B.shape[-1]
    pad = (-length) % chunk_size
    num_chunks = (length + pad) // chunk_size

    def blocks(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t.float(), (0, 0) * (t.dim() - 1) + (0, pad))
        return t.reshape(num_chunks, chunk_size, *t.shape[1:])

    x_dt = blocks(x * dt[..., None])  # [c, Q, H, P]
    a = blocks(dt * A.float())  # [c, Q, H]
    b = blocks(expand_groups(B, num_heads))  # [c, Q, H, N]
    c = blocks(expand_groups(C, num_heads))  # [c, Q, H, N]

    a = a.permute(0, 2, 1)  # [c, H, Q]
    a_cumsum = torch.cumsum(a, dim=-1)

    # Inside each block: y[l] = sum_{s <= l} (C_l . B_s) * exp(a_{s+1} + ... + a_l) * x_dt[s].
    decay = torch.exp(_segment_sums(a))  # [c, H, Q(l), Q(s)]
    scores = torch.einsum("clhn,cshn->chls", c, b) * decay
    y_intra = torch.einsum("chls,cshp->clhp", scores, x_dt)

    # Each block's own contribution to the state at its end.
    decay_to_end = torch.exp(a_cumsum[..., -1:] - a_cumsum)  # [c, H, Q]
    block_states = torch.einsum("clhn,chl,clhp->chpn", b, decay_to_end, x_dt)

    # Carry the state across blocks in one product, not a loop over them:
    # states[z] = sum_{k <= z} exp(decay of blocks k..z-1) * contributed[k],
    # with contributed[0] the initial state and contributed[k] block k-1's.
    state = (
        initial_state.float()
        if initial_state is not None
        else x.new_zeros((num_heads, head_dim, state_size), dtype=torch.float32)
    )
    contributed = torch.cat([state[None], block_states])  # [c + 1, H, P, N]
    block_decay = F.pad(a_cumsum[..., -1].t(), (1, 0))  # [H, c + 1]
    carry = torch.exp(_segment_sums(block_decay))  # [H, c + 1 (z), c + 1 (k)]
    states = torch.einsum("hzk,khpn->zhpn", carry, contributed)
    start_states, state = states[:-1], states[-1]  # [c, H, P, N], the final state

    # The entering state's contribution, decayed to each position of the block.
    y_carry = torch.einsum("clhn,chpn->clhp", c, start_states)
    y_carry = y_carry * torch.exp(a_cumsum).permute(0, 2, 1)[..., None]

    y = (y_intra + y_carry).reshape(num_chunks * chunk_size, num_heads, head_dim)
    return y[:length], state
