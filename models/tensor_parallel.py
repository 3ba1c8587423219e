"""Tensor parallelism inside an instance: which slice of each weight a rank
holds, and the two collectives the sharded model runs.

A rank builds its model from `models.sharding.shard_config(config, rank, size)`: the same
architecture with its share of the attention heads and of the MLP width, so
every layer comes out sized for the shard and `cache_spec()` describes the
rank's own KV cache (its KV heads only). Weights are cut while they are read
(`weight_cut`), so a rank never holds a tensor it does not own.

    column-parallel  q/k/v_proj, gate/up_proj   rows of W: the rank's heads / width
    row-parallel     o_proj, down_proj          matching columns of W; partial sums
                                                are all-reduced, the bias is rank 0's
    vocab-parallel   embed_tokens, lm_head      ceil(vocab / N) rows per rank, the last
                                                zero-padded; lookups are all-reduced,
                                                logits all-gathered
    rank 0 only      a VL wrapper's image path  vision tower and projector; the other
                                                ranks read none of it and receive the
                                                image rows' embeddings by broadcast

Nemotron-H adds the Mamba2 mixer, split by heads: `in_proj` rows are
`z | x | B | C | dt` and `conv1d` channels `x | B | C`, so a rank reads its
heads' part of z, x and dt and, of B and C, its share of the groups from
each section (all groups when `n_groups` does not split over the ranks, see
`models.sharding`); `dt_bias`,
`A_log`, `D` and the norm weight follow the heads, `out_proj` is
row-parallel. MLP and MoE experts (and the shared expert) split along their
intermediate width like gate/up/down; the router is replicated.

KV heads split like the query heads when `num_key_value_heads` is a multiple
of N. With fewer KV heads than ranks, each rank keeps the one KV head its
query heads read (heads 4, KV heads 1, N 2: both ranks hold KV head 0):

    q heads   | 0 1 | 2 3 |       KV head of rank r = r * num_key_value_heads // N
    rank      |  0  |  1  |
    KV head   |  0  |  0  |

The ranks of one instance are the members of the process's default
torch.distributed group (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from models.config import ModelConfig, TensorParallelShard
from models.sharding import mamba_group_range, vocab_rows_per_rank
from models.vl_names import is_image_path

_COLUMN_PARALLEL = ("q_proj", "gate_proj", "up_proj")
_KV_PROJECTIONS = ("k_proj", "v_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")
_VOCAB_PARALLEL = ("embed_tokens", "embeddings", "lm_head")


@dataclass(frozen=True)
class Cut:
    """Read the `ranges` of a tensor along `dim`, one after another, then
    zero-pad that dim to `length`."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    length: int

    @classmethod
    def span(cls, dim: int, start: int, stop: int, length: int | None = None) -> Cut:
        return cls(dim, ((start, stop),), stop - start if length is None else length)

    def read(self, source: Any) -> torch.Tensor:
        """The cut of `source`, a safetensors slice (or a tensor), as a tensor.

        Only the cut's bytes are read from a safetensors slice; a cut of
        length 0 (a tensor the rank does not hold) reads nothing.
        """
        if self.length == 0:
            return torch.empty(0)
        shape = list(source.get_shape() if hasattr(source, "get_shape") else source.shape)
        parts = []
        for start, stop in self.ranges:
            if stop > start:
                parts.append(source[(slice(None),) * self.dim + (slice(start, stop),)])
        taken = sum(stop - start for start, stop in self.ranges)
        if taken < self.length:
            shape[self.dim] = self.length - taken
            parts.append(torch.zeros(shape, dtype=parts[0].dtype if parts else torch.float32))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


def _per_rank(total: int, tp: TensorParallelShard, unit: int = 1) -> tuple[int, int]:
    """Rank's range of `total` items of `unit` entries each, split evenly."""
    share = total // tp.size * unit
    return tp.rank * share, (tp.rank + 1) * share


def _mlp_width(parts: list[str], full: ModelConfig) -> int:
    """Intermediate width of the MLP a projection belongs to."""
    if full.moe is not None and "shared_experts" in parts:
        return full.moe.shared_intermediate_size
    if full.moe is not None and "experts" in parts:
        return full.moe.intermediate_size
    return full.intermediate_size


def _mamba_cut(
    module: str, leaf: str, parent: str, full: ModelConfig, tp: TensorParallelShard
) -> Cut | None:
    """Cuts of a Mamba2 mixer's tensors; None when `module` is none of them.

    in_proj rows are `z | x | B | C | dt` and conv1d channels `x | B | C`: a
    rank takes its heads' slice of z, x and dt and, of B and C, the groups it
    keeps (`models.sharding.mamba_group_range`) from each section.
    """
    mamba = full.mamba
    if mamba is None:
        return None
    inner, bc = mamba.intermediate_size, mamba.n_groups * mamba.state_size
    heads = _per_rank(mamba.num_heads, tp)
    channels = _per_rank(mamba.num_heads, tp, mamba.head_dim)
    first_group, stop_group = mamba_group_range(mamba, tp.rank, tp.size)
    groups = first_group * mamba.state_size, stop_group * mamba.state_size

    def at(offset: int, span: tuple[int, int]) -> tuple[int, int]:
        return offset + span[0], offset + span[1]

    xbc = (channels, at(inner, groups), at(inner + bc, groups))
    if module == "in_proj":
        ranges = (channels, *(at(inner, r) for r in xbc), at(2 * inner + 2 * bc, heads))
        return Cut(0, ranges, sum(b - a for a, b in ranges))
    if module == "conv1d":
        return Cut(0, xbc, sum(b - a for a, b in xbc))
    if module == "mixer" and leaf in ("dt_bias", "A_log", "D"):
        return Cut.span(0, *heads)
    if module == "norm" and parent == "mixer":
        return Cut.span(0, *channels)
    if module == "out_proj":
        if leaf == "bias":
            return Cut.span(0, 0, full.hidden_size if tp.rank == 0 else 0, full.hidden_size)
        return Cut.span(1, *channels)
    return None


def weight_cut(name: str, full: ModelConfig, tp: TensorParallelShard) -> Cut | None:
    """The part of checkpoint tensor `name` rank `tp.rank` holds; None: all of it."""
    if tp.size == 1:
        return None
    parts = name.split(".")
    leaf, module = parts[-1], parts[-2] if len(parts) > 1 else ""
    parent = parts[-3] if len(parts) > 2 else ""
    if is_image_path(name):
        # The image path runs on rank 0 alone (models/nemotron_vl.py).
        return None if tp.rank == 0 else Cut(0, (), 0)
    mamba = _mamba_cut(module, leaf, parent, full, tp)
    if mamba is not None:
        return mamba
    head_dim = full.head_dim
    if module in _VOCAB_PARALLEL:
        rows = vocab_rows_per_rank(full.vocab_size, tp.size)
        start = tp.rank * rows
        return Cut.span(0, start, min(full.vocab_size, start + rows), rows)
    if module == "q_proj":
        return Cut.span(0, *_per_rank(full.num_attention_heads, tp, head_dim))
    if module in _KV_PROJECTIONS:
        kv = full.num_key_value_heads
        first, count = tp.rank * kv // tp.size, max(1, kv // tp.size)
        return Cut.span(0, first * head_dim, (first + count) * head_dim)
    if module in _COLUMN_PARALLEL:
        return Cut.span(0, *_per_rank(_mlp_width(parts, full), tp))
    if module in _ROW_PARALLEL:
        width = full.hidden_size
        if leaf == "bias":  # added once, after the all-reduce: rank 0's alone
            return Cut.span(0, 0, width if tp.rank == 0 else 0, width)
        if module == "o_proj":
            return Cut.span(1, *_per_rank(full.num_attention_heads, tp, head_dim))
        return Cut.span(1, *_per_rank(_mlp_width(parts, full), tp))
    return None


def all_reduce(partial: torch.Tensor, tp: TensorParallelShard) -> torch.Tensor:
    """The sum over the instance's ranks of each rank's `partial` (in place)."""
    if tp.size > 1:
        dist.all_reduce(partial)
    return partial


def gather_vocab(logits: torch.Tensor, tp: TensorParallelShard, vocab_size: int) -> torch.Tensor:
    """Whole-vocabulary logits `[N, vocab_size]` from each rank's vocab shard."""
    if tp.size == 1:
        return logits
    logits = logits.contiguous()
    parts = [torch.empty_like(logits) for _ in range(tp.size)]
    dist.all_gather(parts, logits)
    return torch.cat(parts, dim=-1)[:, :vocab_size]


def broadcast_from_first_rank(
    tensor: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor, tp: TensorParallelShard
) -> torch.Tensor:
    """Rank 0's `tensor` (of `shape`) on every rank, in `like`'s dtype and device;
    the other ranks pass None."""
    if tp.size == 1:
        assert tensor is not None
        return tensor
    if tp.rank == 0:
        assert tensor is not None
        out = tensor.to(dtype=like.dtype, device=like.device).contiguous()
    else:
        out = torch.empty(shape, dtype=like.dtype, device=like.device)
    dist.broadcast(out, src=0)
    return out
