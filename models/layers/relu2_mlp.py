"""Non-gated squared-ReLU feed-forward block of Nemotron-H ("-" layers, experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.layers.fused_linear import FusedLinear


def relu2(x: torch.Tensor) -> torch.Tensor:
    """`relu(x) ** 2`, the activation transformers calls "relu2"."""
    return torch.square(F.relu(x))


class Relu2MLP(torch.nn.Module):
    """`down_proj(relu(up_proj(x)) ** 2)`; no gate projection, checkpoint names.

    `fuse_projections()` prepacks up and down (see `FusedLinear`); the model
    calls it once the weights are loaded, for its "-" layers (MoE experts
    keep their own layout). Until then, or if a fusion went stale, the plain
    layers run.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.up: FusedLinear | None = None
        self.down: FusedLinear | None = None

    def fuse_projections(self) -> None:
        self.up = FusedLinear([self.up_proj])
        self.down = FusedLinear([self.down_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.up is not None and self.up.is_current()
        hidden = self.up(x) if fused and self.up is not None else self.up_proj(x)
        # relu then square in place: one `[T, intermediate]` buffer.
        hidden = F.relu(hidden).square_()
        if self.down is not None and self.down.is_current():
            return self.down(hidden)
        return self.down_proj(hidden)
