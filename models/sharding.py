"""How a model's config splits over tensor-parallel ranks (no torch here, so the
plan and the registry can check a size without loading torch).

`shard_config(config, rank, size)` is the config rank `rank` builds its
model from: its share of the attention heads, the MLP and MoE widths and the
Mamba heads and groups. `models.tensor_parallel` cuts the weights to match.

Mamba2 B/C groups: when `n_groups` splits over the ranks, a rank keeps its
share, which its heads read; otherwise every rank keeps all of them and each
head reads its own group among them (8 heads, 1 group, 2 ranks: both hold
group 0). The gated norm then runs over groups whose heads span ranks, so it
sums across them (`models.layers.mamba2`):

    heads    | 0 1 2 | 3 4 5 |     6 heads, 3 groups, 2 ranks: both keep
    group    | 0 0 1 | 1 2 2 |     groups 0..2; rank 0's heads read 0, 0, 1
    rank     |   0   |   1   |
"""

from __future__ import annotations

from dataclasses import replace

from kvcache.spec import head_shard, mamba_group_span
from models.config import MambaConfig, MambaShard, ModelConfig, TensorParallelShard
from models.errors import ConfigError


def _divides(size: int, config: ModelConfig) -> dict[str, bool]:
    """Per sharded field (as the checkpoint's config.json names it): whether
    `size` ranks can split it."""
    kv = config.num_key_value_heads
    fields = {
        "num_attention_heads": config.num_attention_heads % size == 0,
        "num_key_value_heads": kv % size == 0 or size % kv == 0,
        "intermediate_size": config.intermediate_size % size == 0,
    }
    if config.mamba is not None:
        # n_groups need not split: a group whose heads span ranks is kept by each.
        fields["mamba_num_heads"] = config.mamba.num_heads % size == 0
    if config.moe is not None:
        fields["moe_intermediate_size"] = config.moe.intermediate_size % size == 0
        shared = config.moe.shared_intermediate_size
        fields["moe_shared_expert_intermediate_size"] = shared % size == 0
    return fields


def _field_value(config: ModelConfig, name: str) -> int:
    values = {
        "mamba_num_heads": lambda: config.mamba.num_heads if config.mamba else 0,
        "moe_intermediate_size": lambda: config.moe.intermediate_size if config.moe else 0,
        "moe_shared_expert_intermediate_size": lambda: (
            config.moe.shared_intermediate_size if config.moe else 0
        ),
    }
    return values[name]() if name in values else int(getattr(config, name))


def allowed_sizes(config: ModelConfig) -> list[int]:
    """Every `tensor_parallel_size` this model's head counts and widths allow."""
    return [
        n for n in range(1, config.num_attention_heads + 1) if all(_divides(n, config).values())
    ]


def check_shardable(config: ModelConfig, size: int) -> None:
    """Raise `ConfigError` naming the field and the allowed sizes if `size` ranks
    cannot split this model."""
    if size < 1:
        raise ConfigError(f"tensor_parallel_size must be at least 1, got {size}")
    for name, ok in _divides(size, config).items():
        if not ok:
            raise ConfigError(
                f"tensor_parallel_size {size} cannot split {name} = "
                f"{_field_value(config, name)} of {config.architecture}; allowed "
                f"tensor_parallel_size values for this model: "
                f"{', '.join(map(str, allowed_sizes(config)))}"
            )


def shard_config(config: ModelConfig, rank: int, size: int) -> ModelConfig:
    """The config rank `rank` of `size` builds its model from (see the module doc)."""
    check_shardable(config, size)
    if not 0 <= rank < size:
        raise ConfigError(f"tensor-parallel rank {rank} is outside 0..{size - 1}")
    mamba, moe = config.mamba, config.moe
    return replace(
        config,
        num_attention_heads=config.num_attention_heads // size,
        num_key_value_heads=max(1, config.num_key_value_heads // size),
        intermediate_size=config.intermediate_size // size,
        mamba=None if mamba is None else _shard_mamba(mamba, rank, size),
        moe=None
        if moe is None
        else replace(
            moe,
            intermediate_size=moe.intermediate_size // size,
            shared_intermediate_size=moe.shared_intermediate_size // size,
        ),
        # A VL wrapper's image path runs on rank 0 alone (models/nemotron_vl.py).
        vision=config.vision if rank == 0 else None,
        tp=TensorParallelShard(rank, size),
        cache_shard=head_shard(
            rank,
            size,
            config.num_key_value_heads,
            mamba.num_heads if mamba else 0,
            mamba.n_groups if mamba else 0,
        ),
    )


def mamba_group_range(mamba: MambaConfig, rank: int, size: int) -> tuple[int, int]:
    """The B/C groups rank `rank` of `size` keeps (`mamba` is the whole
    model's), by the rule its cache follows (`kvcache.spec.mamba_group_span`)."""
    return mamba_group_span(mamba.n_groups, rank, size)


def _shard_mamba(mamba: MambaConfig, rank: int, size: int) -> MambaConfig:
    first, stop = mamba_group_range(mamba, rank, size)
    per_rank = mamba.num_heads // size
    shard = MambaShard(
        first_head=rank * per_rank,
        first_group=first,
        model_heads=mamba.num_heads,
        model_groups=mamba.n_groups,
        tp=TensorParallelShard(rank, size),
    )
    return replace(mamba, num_heads=per_rank, n_groups=stop - first, shard=shard)


def vocab_rows_per_rank(vocab_size: int, size: int) -> int:
    return -(-vocab_size // size)
