"""Root-mean-square layer norm, computed in float32 like the reference models."""

from __future__ import annotations

import torch

from models.kernels import dispatch


class RMSNorm(torch.nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)`; the statistic is taken in float32.

    `add_and_norm(x, residual)` is the pre-norm decoder's `residual = residual
    + x` followed by this norm, in one pass on CPU (see `dispatch.rms_norm`).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(residual + x), residual + x)`; `residual` is updated in place."""
        return dispatch.rms_norm(x, self.weight, self.eps, residual), residual
