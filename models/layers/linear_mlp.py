"""Gated SiLU feed-forward block (SwiGLU) of Llama-style decoders."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.kernels import dispatch
from models.layers.fused_linear import FusedLinear


class SwiGLUMLP(torch.nn.Module):
    """`down_proj(silu(gate_proj(x)) * up_proj(x))`, Hugging Face parameter names.

    `fuse_projections()` (called once the weights are loaded) runs gate and up
    as one matmul and prepacks down (see `FusedLinear`); until then, or if the
    fusion went stale, the plain layers run.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.gate_up: FusedLinear | None = None
        self.down: FusedLinear | None = None

    def fuse_projections(self) -> None:
        self.gate_up = FusedLinear([self.gate_proj, self.up_proj])
        self.down = FusedLinear([self.down_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None and self.gate_up.is_current():
            hidden = dispatch.silu_mul(self.gate_up(x))
        else:
            # In place into silu's fresh output: one `[T, intermediate]` buffer less.
            hidden = F.silu(self.gate_proj(x)).mul_(self.up_proj(x))
        if self.down is not None and self.down.is_current():
            return self.down(hidden)
        return self.down_proj(hidden)
