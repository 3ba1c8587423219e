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
        # One fused kernel for the statistic and scaling (the reference models'
        # five elementwise ops); on bf16/fp16 input it accumulates in float32
        # and rounds once to the input dtype, as the reference's explicit
        # float32 round trip does. Then the weight, as they apply it.
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
