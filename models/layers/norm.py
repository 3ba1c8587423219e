"""Root-mean-square layer norm, computed in float32 like the reference models."""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)`; the statistic is taken in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        normed = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * normed.to(input_dtype)
