"""Tensor parallelism inside an instance: which slice of each weight a rank
holds, and the two collectives the sharded model runs.

A rank builds its model from `shard_config(config, rank, size)`: the same
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

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from models.config import DECODER, ModelConfig, TensorParallelShard
from models.errors import ConfigError

_COLUMN_PARALLEL = ("q_proj", "gate_proj", "up_proj")
_KV_PROJECTIONS = ("k_proj", "v_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")
_VOCAB_PARALLEL = ("embed_tokens", "lm_head")


def _divides(size: int, config: ModelConfig) -> dict[str, bool]:
    """Per sharded field: whether `size` ranks can split it."""
    kv = config.num_key_value_heads
    return {
        "num_attention_heads": config.num_attention_heads % size == 0,
        "num_key_value_heads": kv % size == 0 or size % kv == 0,
        "intermediate_size": config.intermediate_size % size == 0,
    }


def allowed_sizes(config: ModelConfig) -> list[int]:
    """Every `tensor_parallel_size` this model's head counts and MLP width allow."""
    return [
        n for n in range(1, config.num_attention_heads + 1) if all(_divides(n, config).values())
    ]


def check_shardable(config: ModelConfig, size: int) -> None:
    """Raise `ConfigError` naming the field and the allowed sizes if `size` ranks
    cannot split this model."""
    if size < 1:
        raise ConfigError(f"tensor_parallel_size must be at least 1, got {size}")
    if size == 1:
        return
    others = sorted({kind for kind in config.layer_types if kind != DECODER})
    if others or config.mamba is not None or config.moe is not None:
        raise ConfigError(
            f"tensor_parallel_size {size}: {config.architecture} has {', '.join(others)} layers, "
            "and tensor parallelism covers dense decoder models (Llama, Mistral, Qwen2) so far; "
            "set tensor_parallel_size to 1"
        )
    for name, ok in _divides(size, config).items():
        if not ok:
            value = getattr(config, name)
            raise ConfigError(
                f"tensor_parallel_size {size} cannot split {name} = {value} of "
                f"{config.architecture}; allowed tensor_parallel_size values for this model: "
                f"{', '.join(map(str, allowed_sizes(config)))}"
            )


def shard_config(config: ModelConfig, rank: int, size: int) -> ModelConfig:
    """The config rank `rank` of `size` builds its model from (see the module doc)."""
    check_shardable(config, size)
    if not 0 <= rank < size:
        raise ConfigError(f"tensor-parallel rank {rank} is outside 0..{size - 1}")
    return replace(
        config,
        num_attention_heads=config.num_attention_heads // size,
        num_key_value_heads=max(1, config.num_key_value_heads // size),
        intermediate_size=config.intermediate_size // size,
        tp=TensorParallelShard(rank, size),
    )


def vocab_rows_per_rank(vocab_size: int, size: int) -> int:
    return -(-vocab_size // size)


@dataclass(frozen=True)
class Cut:
    """Read `[start, stop)` of a tensor along `dim`, then zero-pad that dim to `length`."""

    dim: int
    start: int
    stop: int
    length: int

    def read(self, source: Any) -> torch.Tensor:
        """The cut of `source`, a safetensors slice (or a tensor), as a tensor.

        Only the cut's bytes are read from a safetensors slice.
        """
        shape = list(source.get_shape() if hasattr(source, "get_shape") else source.shape)
        if self.stop > self.start:
            index = (slice(None),) * self.dim + (slice(self.start, self.stop),)
            part = source[index]
        else:
            shape[self.dim] = 0
            part = torch.zeros(shape)
        pad = self.length - (self.stop - self.start)
        if pad == 0:
            return part
        shape[self.dim] = pad
        return torch.cat([part, torch.zeros(shape, dtype=part.dtype)], dim=self.dim)


def weight_cut(name: str, full: ModelConfig, tp: TensorParallelShard) -> Cut | None:
    """The part of checkpoint tensor `name` rank `tp.rank` holds; None: all of it."""
    if tp.size == 1:
        return None
    module, _, kind = name.rpartition(".")
    module = module.rpartition(".")[2]
    rank, size, head_dim = tp.rank, tp.size, full.head_dim
    if module in _VOCAB_PARALLEL:
        rows = vocab_rows_per_rank(full.vocab_size, size)
        return Cut(0, rank * rows, min(full.vocab_size, (rank + 1) * rows), rows)
    if module == "q_proj":
        per_rank = full.num_attention_heads // size * head_dim
        return Cut(0, rank * per_rank, (rank + 1) * per_rank, per_rank)
    if module in _KV_PROJECTIONS:
        kv = full.num_key_value_heads
        first = rank * kv // size
        count = max(1, kv // size)
        return Cut(0, first * head_dim, (first + count) * head_dim, count * head_dim)
    if module in _COLUMN_PARALLEL:
        per_rank = full.intermediate_size // size
        return Cut(0, rank * per_rank, (rank + 1) * per_rank, per_rank)
    if module in _ROW_PARALLEL:
        width = full.hidden_size
        if kind == "bias":  # added once, after the all-reduce: rank 0's alone
            return Cut(0, 0, width if rank == 0 else 0, width)
        per_rank = (
            full.num_attention_heads * head_dim if module == "o_proj" else full.intermediate_size
        ) // size
        return Cut(1, rank * per_rank, (rank + 1) * per_rank, per_rank)
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
