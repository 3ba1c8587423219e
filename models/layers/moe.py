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
from models.kernels import dispatch
from models.layers.moe_experts import routed_gathered, stack_expert_weights, views_stack
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
        if cfg.topk_group < cfg.n_group:
            choice = self._in_kept_groups(choice)
        experts = choice.topk(cfg.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return experts, weights * cfg.routed_scaling_factor

    def _in_kept_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` with the experts outside each token's `topk_group` best
        groups at -inf. (With every group kept this masks nothing: the
        forward then skips it, a decode step's dozen small ops fewer.)"""
        cfg = self.config
        per_group = choice.view(-1, cfg.n_group, cfg.num_experts // cfg.n_group)
        group_scores = per_group.topk(_EXPERTS_PER_GROUP_SCORE, dim=-1).values.sum(-1)
        kept_groups = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
        group_mask.scatter_(1, kept_groups, True)
        expert_mask = group_mask.repeat_interleave(cfg.num_experts // cfg.n_group, dim=1)
        return choice.masked_fill(~expert_mask, float("-inf"))


class NemotronHMoE(nn.Module):
    """Routed relu² experts plus the shared expert; `[T, hidden]` -> `[T, hidden]`.

    The experts' weights live in `up_weights [E, I, H]` and `down_weights
    [E, H, I]`, which their checkpoint-named layers view (see
    `models.layers.moe_experts`); only the experts a step chose run.
    """

    up_weights: torch.Tensor
    down_weights: torch.Tensor

    def __init__(self, hidden_size: int, config: MoEConfig, shared_bias: bool = False) -> None:
        super().__init__()
        self.gate = TopkRouter(hidden_size, config)
        # Routed experts never carry biases; the shared expert follows `mlp_bias`.
        self.experts = nn.ModuleList(
            Relu2MLP(hidden_size, config.intermediate_size) for _ in range(config.num_experts)
        )
        self.up_weights, self.down_weights = stack_expert_weights(self.experts)
        self.shared_experts = (
            Relu2MLP(hidden_size, config.shared_intermediate_size, shared_bias)
            if config.shared_intermediate_size > 0
            else None
        )

    def _apply(
        self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
    ) -> NemotronHMoE:
        # Casting or moving converts every expert's weight on its own, off the
        # stack: stack them again (the stack is no parameter, so `fn` skips it).
        super()._apply(fn, recurse)
        if not views_stack(self.experts, self.up_weights, self.down_weights):
            self.up_weights, self.down_weights = stack_expert_weights(self.experts)
        return self

    def forward(self, x: torch.Tensor, sync_free: bool = False) -> torch.Tensor:
        """`sync_free` (GPU decode steps): never read the routing back to the
        host, so the step does not wait on the device (`routed_gathered`);
        otherwise each chosen expert runs once on its rows, with the shared
        expert in the same call where it has no bias (`dispatch.moe_experts`).
        Either way only the chosen experts' weights are read."""
        experts, weights = self.gate(x)
        mlp = self.shared_experts
        if sync_free:
            out = routed_gathered(x, experts, weights, self.up_weights, self.down_weights)
            out = out.to(x.dtype)
            return out if mlp is None else out + mlp(x)
        # The shared expert joins the routed experts' call unless it has a
        # bias (the kernel takes none).
        shared = None
        if mlp is not None and mlp.up_proj.bias is None:
            shared = (mlp.up_proj.weight, mlp.down_proj.weight)
        out = dispatch.moe_experts(x, experts, weights, self.up_weights, self.down_weights, shared)
        return out if mlp is None or shared is not None else out + mlp(x)
