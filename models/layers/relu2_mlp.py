"""Non-gated squared-ReLU feed-forward block of Nemotron-H ("-" layers, experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def relu2(x: torch.Tensor) -> torch.Tensor:
    """`relu(x) ** 2`, the activation transformers calls "relu2"."""
    return torch.square(F.relu(x))


class Relu2MLP(torch.nn.Module):
    """`down_proj(relu(up_proj(x)) ** 2)`; no gate projection, checkpoint names."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))
