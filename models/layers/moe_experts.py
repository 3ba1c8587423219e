"""The routed experts of a Nemotron-H MoE layer: their weights stacked in one
tensor per projection, and the paths that run only the experts a step chose.

Each expert keeps its checkpoint-named `nn.Linear` layers, but their
weights view one row of the stack, so the weights exist once:

    up    [E, I, H]   experts.e.up_proj.weight   == up[e]
    down  [E, H, I]   experts.e.down_proj.weight == down[e]

Every path returns `sum_k weights[t, k] * expert_{experts[t, k]}(x[t])`,
`[T, H]`; an expert is `down @ relu(up @ x) ** 2`:

- grouped (`dispatch.moe_experts`): the (token, k) pairs sorted by expert,
  each chosen expert run once on its rows, through the C kernel on CPU (all
  experts and the shared expert in one call) or one product per expert with
  rows (the segment bounds read from the device once). Each chosen expert's
  weights are read once for all of its rows.
- `routed_gathered`: each pair's expert weights gathered and multiplied by
  batched matmuls. No host read, so a GPU decode step never waits on the
  device (and can be captured); only chosen experts are read, once per pair.
- `routed_by_expert_loop`: the loop over the chosen experts' own layers,
  one device read per expert: the reference the other two are tested
  against, and the path they replace (`benchmarks.moe_bench`).
"""

from __future__ import annotations

import torch
from torch import nn

from models.layers.relu2_mlp import Relu2MLP, relu2

# The most bytes of expert weights `routed_gathered` copies at a time; a
# step with more pairs runs in slices of pairs.
GATHER_BYTES = 256 << 20


def stack_expert_weights(experts: nn.ModuleList) -> tuple[torch.Tensor, torch.Tensor]:
    """`(up [E, I, H], down [E, H, I])` holding the experts' weights, each
    expert's `up_proj` / `down_proj` weight replaced by a view of its row
    (same names, shapes, dtype and device; no second copy)."""
    mlps = [_as_mlp(module) for module in experts]
    up = _stacked([mlp.up_proj.weight for mlp in mlps])
    down = _stacked([mlp.down_proj.weight for mlp in mlps])
    for e, mlp in enumerate(mlps):
        mlp.up_proj.weight = nn.Parameter(up[e], requires_grad=False)
        mlp.down_proj.weight = nn.Parameter(down[e], requires_grad=False)
    return up, down


def _stacked(weights: list[torch.Tensor]) -> torch.Tensor:
    # Not torch.stack: on the meta device (a shape-only check of a
    # checkpoint) it runs a Python decomposition that imports torch._dynamo.
    first = weights[0]
    out = torch.empty((len(weights), *first.shape), dtype=first.dtype, device=first.device)
    with torch.no_grad():
        for row, weight in zip(out, weights, strict=True):
            row.copy_(weight)
    return out


def views_stack(experts: nn.ModuleList, up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether every expert's weights still view their rows of `up` / `down`
    (casting or moving a module converts each parameter on its own)."""
    for e, module in enumerate(experts):
        mlp = _as_mlp(module)
        if mlp.up_proj.weight.data_ptr() != up[e].data_ptr():
            return False
        if mlp.down_proj.weight.data_ptr() != down[e].data_ptr():
            return False
    return True


def _as_mlp(module: nn.Module) -> Relu2MLP:
    if not isinstance(module, Relu2MLP):
        raise TypeError(f"a routed expert must be a Relu2MLP, not {type(module).__name__}")
    return module


def routed_gathered(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """The routed experts' weighted sum with no host read: per (token, k)
    pair, the expert's weights gathered and applied by batched matmuls."""
    num_tokens, top_k = experts.shape
    flat = experts.flatten()
    # Pair p is (token p // top_k, its k-th expert).
    rows = x[:, None, :].expand(num_tokens, top_k, x.shape[1]).reshape(-1, x.shape[1])
    pair_bytes = (up[0].numel() + down[0].numel()) * up.element_size()
    per_slice = max(1, GATHER_BYTES // pair_bytes)
    out_rows = torch.empty(flat.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    for start in range(0, flat.shape[0], per_slice):
        ids = flat[start : start + per_slice]
        hidden = relu2(torch.bmm(up[ids], rows[start : start + per_slice, :, None]))
        out_rows[start : start + per_slice] = torch.bmm(down[ids], hidden).squeeze(-1)
    weighted = out_rows * weights.flatten()[:, None]
    return weighted.view(num_tokens, top_k, -1).sum(1)


def routed_by_expert_loop(
    x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, modules: nn.ModuleList
) -> torch.Tensor:
    """The reference: each chosen expert's own layers on its tokens, found
    with one device read per expert."""
    out = torch.zeros_like(x, dtype=weights.dtype)
    for expert_id in torch.unique(experts).tolist():
        token_idx, k_idx = torch.nonzero(experts == expert_id, as_tuple=True)
        expert_out = modules[expert_id](x[token_idx])
        out.index_add_(0, token_idx, expert_out * weights[token_idx, k_idx, None])
    return out
