"""Root-mean-square layer norm, computed in float32 like the reference models."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)`; the statistic is taken in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel for the float32 statistic and scaling (the reference
        # models' five elementwise ops), then the cast and the weight as they do.
        normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)
