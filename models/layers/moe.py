"""Nemotron-H mixture of experts: grouped sigmoid routing over relu² experts
plus an always-on shared expert.

Routing, per token (as transformers' `NemotronHTopkRouter`, in float32):

    scores  = sigmoid(x @ gate.weight.T)                        [E]
    choice  = scores + e_score_correction_bias                  (selection only)
    groups  = E experts split into n_group groups; a group's score is the
              sum of its two best `choice` values; keep the topk_group best
    experts = top_k of `choice` within the kept groups
    weights = scores[experts] (not `choice`), divided by their sum when
              norm_topk_prob, then times routed_scaling_factor

    out = sum_k weights[k] * expert_k(x) + shared_experts(x)

Checkpoint names: `gate.weight`, `gate.e_score_correction_bias`,
`experts.N.{up,down}_proj.weight`, `shared_experts.{up,down}_proj.weight`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from models.config import MoEConfig
from models.layers.relu2_mlp import Relu2MLP

# A group's score sums its best two experts (DeepSeek-V3 style), as the reference does.
_EXPERTS_PER_GROUP_SCORE = 2


class TopkRouter(nn.Module):
    """Scores experts and picks `top_k` per token; weights stay in float32."""

    def __init__(self, hidden_size: int, config: MoEConfig) -> None:
        super().__init__()
        if config.num_experts % config.n_group:
            raise ValueError(
                f"num_experts {config.num_experts} is not divisible by n_group {config.n_group}"
            )
        if config.num_experts // config.n_group < _EXPERTS_PER_GROUP_SCORE:
            raise ValueError(
                f"n_group {config.n_group} leaves fewer than {_EXPERTS_PER_GROUP_SCORE} of the "
                f"{config.num_experts} experts per group; lower n_group"
            )
        if config.topk_group > config.n_group:
            raise ValueError(f"topk_group {config.topk_group} exceeds n_group {config.n_group}")
        self.config = config
        self.weight = nn.Parameter(
            torch.zeros(config.num_experts, hidden_size, dtype=torch.float32)
        )
        # A checkpoint tensor, so a (frozen) parameter: the loader fills parameters by name.
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(config.num_experts, dtype=torch.float32), requires_grad=False
        )

    def _apply(
        self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
    ) -> TopkRouter:
        # The router stays float32 when the model is cast (as transformers keeps
        # it): bf16 routing scores would pick different experts on near ties.
        super()._apply(fn, recurse)
        for param in self.parameters(recurse=False):
            param.data = param.data.float()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, hidden]` -> `(expert ids [T, top_k] int64, weights [T, top_k] float32)`."""
        cfg = self.config
        scores = torch.sigmoid(x.float() @ self.weight.float().t())
        choice = scores + self.e_score_correction_bias.float()
        per_group = choice.view(-1, cfg.n_group, cfg.num_experts // cfg.n_group)
        group_scores = per_group.topk(_EXPERTS_PER_GROUP_SCORE, dim=-1).values.sum(-1)
        kept_groups = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
        group_mask.scatter_(1, kept_groups, True)
        expert_mask = group_mask.repeat_interleave(cfg.num_experts // cfg.n_group, dim=1)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
        experts = choice.topk(cfg.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return experts, weights * cfg.routed_scaling_factor


class NemotronHMoE(nn.Module):
    """Routed relu² experts plus the shared expert; `[T, hidden]` -> `[T, hidden]`."""

    def __init__(self, hidden_size: int, config: MoEConfig, shared_bias: bool = False) -> None:
        super().__init__()
        self.gate = TopkRouter(hidden_size, config)
        # Routed experts never carry biases; the shared expert follows `mlp_bias`.
        self.experts = nn.ModuleList(
            Relu2MLP(hidden_size, config.intermediate_size) for _ in range(config.num_experts)
        )
        self.shared_experts = (
            Relu2MLP(hidden_size, config.shared_intermediate_size, shared_bias)
            if config.shared_intermediate_size > 0
            else None
        )

    def forward(self, x: torch.Tensor, sync_free: bool = False) -> torch.Tensor:
        """`sync_free` (GPU decode steps) runs every expert on every token instead of
        asking the device which experts were chosen: no host read, so the step
        can be captured in a CUDA graph, at the cost of computing unchosen
        experts (which a decode step, bound by reading the weights, mostly
        reads anyway once a batch spreads over the experts)."""
        experts, weights = self.gate(x)
        if sync_free:
            out = self._every_expert(x, experts, weights)
        else:
            out = self._chosen_experts(x, experts, weights)
        out = out.to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _chosen_experts(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(x, dtype=weights.dtype)
        # Loop over the experts that received tokens, not over tokens: each
        # expert runs once on all of its tokens. Finding them reads the device.
        for expert_id in torch.unique(experts).tolist():
            token_idx, k_idx = torch.nonzero(experts == expert_id, as_tuple=True)
            expert_out = self.experts[expert_id](x[token_idx])
            out.index_add_(0, token_idx, expert_out * weights[token_idx, k_idx, None])
        return out

    def _every_expert(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        # [T, E] routing weights, zero where an expert was not chosen; experts
        # add up in ascending id order, as in `_chosen_experts`.
        dense = torch.zeros(x.shape[0], len(self.experts), dtype=weights.dtype, device=x.device)
        dense.scatter_(1, experts, weights)
        out = torch.zeros_like(x, dtype=weights.dtype)
        for expert_id, expert in enumerate(self.experts):
            out += expert(x) * dense[:, expert_id, None]
        return out
