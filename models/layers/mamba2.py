"""The Mamba2 mixer of Nemotron-H, over a flattened mixed prefill/decode batch.

Per token: `in_proj` splits into the gate z, the conv input xBC and the raw
time step dt; xBC goes through a causal depthwise conv1d (kernel K) and SiLU,
then splits into x, B, C; the SSD recurrence (`models/layers/ssd.py`) turns
x, B, C, dt into y; `y + D * x` is normalized by a grouped RMSNorm gated with
silu(z), then `out_proj` maps it back to the hidden size.

State per sequence lives in a slot of `MambaLayerCache`:

    conv_state[slot]  [conv_dim, K - 1]   the last K - 1 conv inputs
    ssm_state[slot]   [H, P, N] float32   the recurrence state

A sequence with `context_lens == 0` starts from zero state (its slot is
cleared first); any other sequence continues from what its slot holds, whether
it brings one decode token or a further prompt chunk. Prefill chunks run the
chunked scan one sequence at a time (on CPU, one C call runs every chunk's
tokens as the recurrence itself instead); single-token steps are batched into one
call of the decode-step state update (`models.kernels.dispatch`: the Triton
kernel on CUDA; on CPU one C call for the conv shift and the state update
together, `models.kernels.cpu_mamba_step`, else the torch twins). A speculative verify (a token and its
drafts) runs as decode steps too, one batched call per draft position, each
writing its state into the next scratch slot (`kvcache.verify_slots`), so the
state after any accepted position survives.

Time step rule: `dt = clamp(softplus(dt_raw + dt_bias), *time_step_limit)` in
every path, prefill and decode alike. (transformers' Nemotron-H instead clamps
at `time_step_min` in its multi-token path only and not in its one-token
path; one rule for both paths keeps prefill and decode of the same sequence
consistent. The two agree whenever softplus never falls below `time_step_min`.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvcache.views import MambaLayerCache
from models.batch import ForwardBatch
from models.config import MambaConfig, MambaShard
from models.kernels import dispatch
from models.kernels.cpu_mamba_step import MambaStepWeights
from models.kernels.cpu_mamba_step import causal_conv_step_ref as causal_conv_step
from models.layers.fused_linear import FusedLinear
from models.layers.ssd import ssd_chunked_scan
from models.tensor_parallel import all_reduce


class GatedGroupRMSNorm(nn.Module):
    """RMSNorm of `x * silu(z)` over groups of `group_size` channels, then a weight.

    Matches transformers' gated Mamba norm with `norm_before_gate=False`; the
    math runs in float32 and the result is cast back before the weight.
    """

    def __init__(self, hidden_size: int, group_size: int, eps: float) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"hidden_size {hidden_size} is not a multiple of group {group_size}")
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x `[T, hidden]` float32 (the scan's y), z `[T, hidden]` in the
        model dtype -> `[T, hidden]` in z's dtype (one C pass on CPU)."""
        return dispatch.gated_rms_norm(x, z, self.weight, self.group_size, self.eps)


class RankSpanningGatedRMSNorm(nn.Module):
    """`GatedGroupRMSNorm` on a tensor-parallel rank whose groups' heads span
    ranks (`n_groups` does not split over them): each rank sums the squares of
    its heads per group of the whole model, the sums are all-reduced, and each
    head is scaled by its group's mean. Same math, one `[T, n_groups]`
    all-reduce per layer."""

    def __init__(self, num_heads: int, head_dim: int, shard: MambaShard, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_heads * head_dim))
        groups = [shard.first_group + g for g in shard.head_groups(num_heads)]
        # Built on the model's device (the loader's default device), never moved.
        self.head_group = torch.tensor(groups)
        self.head_dim = head_dim
        self.model_groups = shard.model_groups
        self.group_size = shard.heads_per_group * head_dim
        self.tp = shard.tp
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() * F.silu(z.float())
        heads = h.view(*h.shape[:-1], -1, self.head_dim)  # [T, H, P]
        sums = heads.new_zeros(h.shape[0], self.model_groups)
        sums.index_add_(1, self.head_group, heads.pow(2).sum(-1))
        mean = all_reduce(sums, self.tp) / self.group_size
        scale = torch.rsqrt(mean + self.eps)[:, self.head_group]  # [T, H]
        return self.weight * (heads * scale[..., None]).view_as(h).to(dtype)


def causal_conv_chunk(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d of one sequence's chunk, continuing from `state`.

    x: `[L, D]` new inputs; state: `[D, K - 1]` the inputs before them (zeros
    for a fresh sequence); weight: `[D, K]`. Returns `(out [L, D]` before the
    activation, `new_state [D, K - 1])`, the last K - 1 inputs of state + x.
    """
    window = torch.cat([state.to(x.dtype), x.t()], dim=-1)  # [D, K - 1 + L]
    out = F.conv1d(window[None], weight[:, None, :], bias, groups=weight.shape[0])[0]
    return out.t(), window[:, -(weight.shape[1] - 1) :]


class Mamba2Mixer(nn.Module):
    """Nemotron-H Mamba2 mixer; parameter names follow the checkpoint
    (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`, `out_proj`).

    `fuse_projections()` (called once the weights are loaded) prepacks
    in_proj and out_proj (see `FusedLinear`); until then, or if a fusion went
    stale, the plain layers run.
    """

    def __init__(self, hidden_size: int, config: MambaConfig) -> None:
        super().__init__()
        self.config = config
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.intermediate = config.intermediate_size
        self.conv_dim = config.conv_dim
        self.bc_size = config.n_groups * config.state_size
        self.in_proj = nn.Linear(
            hidden_size, self.intermediate + self.conv_dim + self.num_heads, bias=config.use_bias
        )
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            kernel_size=config.conv_kernel,
            groups=self.conv_dim,
            bias=config.use_conv_bias,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        shard = config.shard
        self.norm: nn.Module
        if shard is None or shard.whole_groups:
            self.norm = GatedGroupRMSNorm(
                self.intermediate, self.intermediate // config.n_groups, config.norm_eps
            )
        else:
            self.norm = RankSpanningGatedRMSNorm(
                self.num_heads, self.head_dim, shard, config.norm_eps
            )
        # Built on the model's device (the loader's default device), never moved.
        self.bc_of_head = _bc_of_head(config)
        self.out_proj = nn.Linear(self.intermediate, hidden_size, bias=config.use_bias)
        self.in_fused: FusedLinear | None = None
        self.out_fused: FusedLinear | None = None

    def fuse_projections(self) -> None:
        self.in_fused = FusedLinear([self.in_proj])
        self.out_fused = FusedLinear([self.out_proj])

    def _project_in(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.in_fused is not None and self.in_fused.is_current():
            return self.in_fused(hidden)
        return self.in_proj(hidden)

    def _project_out(self, y: torch.Tensor) -> torch.Tensor:
        if self.out_fused is not None and self.out_fused.is_current():
            return self.out_fused(y)
        return self.out_proj(y)

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, cache: MambaLayerCache
    ) -> torch.Tensor:
        """hidden `[T, hidden]` -> `[T, hidden]`; updates the slots of `batch.mamba_slots`."""
        if batch.mamba_slots is None or batch.mamba_rows is None:
            raise ValueError("a hybrid Mamba model needs ForwardBatch.mamba_slots")
        shape, rows = batch.shape, batch.mamba_rows
        # Which sequences are fresh, single tokens or chunks is known on the
        # host (`batch.shape`); the device only sees index tensors.
        if shape.fresh_seqs:
            cache.conv_state[rows.fresh_slots] = 0
            cache.ssm_state[rows.fresh_slots] = 0

        z, xbc, dt_raw = self._project_in(hidden).split(
            [self.intermediate, self.conv_dim, self.num_heads], dim=-1
        )
        if batch.is_decode_only:
            y = self._step(xbc, dt_raw, batch.mamba_slots, cache)
        else:
            y = self._mixed(xbc, dt_raw, batch, cache)

        # The norm runs in float32 on the float32 scan output; only its result
        # is cast to the model dtype (as transformers' multi-token path does).
        y = self.norm(y.view(hidden.shape[0], -1), z)
        return self._project_out(y.to(hidden.dtype))

    def _mixed(
        self, xbc: torch.Tensor, dt_raw: torch.Tensor, batch: ForwardBatch, cache: MambaLayerCache
    ) -> torch.Tensor:
        """y `[T, H, P]` float32 of a step that mixes single tokens and prompt chunks."""
        shape, rows = batch.shape, batch.mamba_rows
        assert rows is not None and shape.mamba_slots is not None
        y = torch.empty(xbc.shape[0], self.num_heads, self.head_dim, device=xbc.device)
        if shape.single_token_seqs:
            step = rows.step_rows
            y[step] = self._step(xbc[step], dt_raw[step], rows.step_slots, cache)
        for verify in batch.verify_rounds:
            at = verify.rows
            y[at] = self._step(xbc[at], dt_raw[at], verify.read_slots, cache, verify.write_slots)
        starts = shape.query_start_loc
        scans = shape.scan_seqs
        if scans and self.bc_of_head is None:
            # On CPU one C call runs every chunk's tokens as the recurrence.
            slots = [shape.mamba_slots[i] for i in scans]
            spans = [(starts[i], starts[i + 1]) for i in scans]
            weights = self._step_weights()
            if dispatch.cpu_mamba_chunk_scan(
                xbc, dt_raw, cache.conv_state, cache.ssm_state, slots, spans, weights, y
            ):
                return y
        # One scan per prompt chunk, sliced by host counts (no read back): each
        # continues its own conv and SSM state, and a step holds few chunks.
        for i in scans:
            start, end = starts[i], starts[i + 1]
            y[start:end] = self._prefill(
                xbc[start:end], dt_raw[start:end], shape.mamba_slots[i], cache
            )
        return y

    def _step_weights(self) -> MambaStepWeights:
        return MambaStepWeights(
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
            self.dt_bias,
            self._A,
            self.D,
            self.config.n_groups,
            self.config.time_step_limit,
        )

    @property
    def _A(self) -> torch.Tensor:
        return -torch.exp(self.A_log.float())

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Activated conv output `[n, conv_dim]` -> x `[n, H, P]`, B and C `[n, G, N]`."""
        x, B, C = F.silu(xbc).split([self.intermediate, self.bc_size, self.bc_size], dim=-1)
        groups = (xbc.shape[0], self.config.n_groups, self.config.state_size)
        B, C = B.reshape(groups), C.reshape(groups)
        if self.bc_of_head is not None:  # per head: [n, H, N]
            B, C = B[:, self.bc_of_head], C[:, self.bc_of_head]
        return x.reshape(-1, self.num_heads, self.head_dim), B, C

    def _prefill(
        self, xbc: torch.Tensor, dt_raw: torch.Tensor, slot: int, cache: MambaLayerCache
    ) -> torch.Tensor:
        """One sequence's prompt chunk `[L, conv_dim]` -> y `[L, H, P]` float32."""
        weight = self.conv1d.weight.squeeze(1)
        conv_out, cache.conv_state[slot] = causal_conv_chunk(
            xbc, cache.conv_state[slot], weight, self.conv1d.bias
        )
        x, B, C = self._split_xbc(conv_out)
        dt = F.softplus(dt_raw.float() + self.dt_bias.float())
        dt = dt.clamp(*self.config.time_step_limit)
        y, cache.ssm_state[slot] = ssd_chunked_scan(
            x, dt, self._A, B, C, self.config.chunk_size, initial_state=cache.ssm_state[slot]
        )
        return y + x.float() * self.D.float()[:, None]

    def _step(
        self,
        xbc: torch.Tensor,
        dt_raw: torch.Tensor,
        slots: torch.Tensor,
        cache: MambaLayerCache,
        out_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """b single tokens `[b, conv_dim]` -> y `[b, H, P]` float32 (D skip
        included); the new states go to `out_slots` when given."""
        weight = self.conv1d.weight.squeeze(1)
        if self.bc_of_head is None:
            y = dispatch.cpu_mamba_decode_step(
                xbc,
                dt_raw,
                cache.conv_state,
                cache.ssm_state,
                slots,
                self._step_weights(),
                out_slots,
            )
            if y is not None:
                return y
        conv_out = causal_conv_step(
            xbc, cache.conv_state, slots, weight, self.conv1d.bias, out_slots
        )
        x, B, C = self._split_xbc(conv_out)
        return dispatch.mamba_state_update(
            cache.ssm_state,
            slots,
            x,
            dt_raw,
            self.dt_bias,
            self._A,
            B,
            C,
            self.D,
            dt_limit=self.config.time_step_limit,
            out_slot_indices=out_slots,
        ).float()


def _bc_of_head(config: MambaConfig) -> torch.Tensor | None:
    """Which of the rank's B/C groups each of its heads reads, where that is not
    the even split `h // (heads / groups)` the scan and the decode step assume
    (a tensor-parallel rank that keeps every group because `n_groups` does not
    split over the ranks); None where it is."""
    if config.shard is None:
        return None
    groups = config.shard.head_groups(config.num_heads)
    per_group = config.num_heads // config.n_groups
    even = config.num_heads % config.n_groups == 0
    if even and groups == tuple(h // per_group for h in range(config.num_heads)):
        return None
    return torch.tensor(groups)
