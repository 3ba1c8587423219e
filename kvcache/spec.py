"""What a model needs from the cache: the shapes the managers lay out.

`CacheSpec` is the one contract between `models/` (which derives it from a
model config) and `kvcache/` (which sizes and lays out pools from it). It is
pure Python so the bookkeeping never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from kvcache.dtypes import DTYPE_BYTES


@dataclass(frozen=True)
class CacheSpec:
    """Cache shapes of one model.

    attention_layers: model layer indices that own paged KV, in order; the
        position of a layer in this tuple is its *attention ordinal*.
    mamba_layers: model layer indices with Mamba state, in order (mamba ordinal).
    conv_state_shape: per slot and Mamba layer, `(conv_dim, conv_kernel - 1)`,
        stored in `dtype`.
    ssm_state_shape: per slot and Mamba layer, `(num_heads, head_dim, state_size)`,
        always stored in float32.
    shard: which of the model's heads these shapes hold, for one rank of a
        tensor-parallel instance; None: all of them (one rank).
    """

    num_kv_heads: int
    head_dim: int
    attention_layers: tuple[int, ...]
    dtype: str = "float32"
    mamba_layers: tuple[int, ...] = ()
    conv_state_shape: tuple[int, ...] = ()
    ssm_state_shape: tuple[int, ...] = ()
    shard: HeadShard | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(
                f"unsupported cache dtype {self.dtype!r}; use one of {sorted(DTYPE_BYTES)}"
            )

    @property
    def is_hybrid(self) -> bool:
        return bool(self.mamba_layers)

    @cached_property
    def heads(self) -> HeadShard:
        """The model heads this cache holds (all of them without a `shard`)."""
        if self.shard is not None:
            return self.shard
        num_heads = self.ssm_state_shape[0] if self.mamba_layers else 0
        return head_shard(0, 1, self.num_kv_heads, num_heads, self.num_mamba_groups)

    def for_rank(self, rank: int, size: int) -> CacheSpec:
        """This whole-model spec as rank `rank` of `size` tensor-parallel ranks
        holds it (its heads only)."""
        if self.shard is not None and self.shard.size != 1:
            raise ValueError("for_rank shards a whole-model spec; this one is a shard already")
        whole = self.heads
        shard = head_shard(
            rank, size, whole.total_kv_heads, whole.total_mamba_heads, whole.total_mamba_groups
        )
        conv, ssm = self.conv_state_shape, self.ssm_state_shape
        if self.mamba_layers:
            _, head_dim, state_size = ssm
            heads = _length(shard.mamba_heads)
            conv = (heads * head_dim + 2 * _length(shard.mamba_groups) * state_size, *conv[1:])
            ssm = (heads, head_dim, state_size)
        return replace(
            self,
            num_kv_heads=_length(shard.kv_heads),
            conv_state_shape=conv,
            ssm_state_shape=ssm,
            shard=shard,
        )

    @property
    def num_mamba_groups(self) -> int:
        """B/C groups of this cache's conv state: `conv_dim = heads * head_dim
        + 2 * groups * state_size`."""
        if not self.mamba_layers:
            return 0
        num_heads, head_dim, state_size = self.ssm_state_shape
        return (self.conv_state_shape[0] - num_heads * head_dim) // (2 * state_size)

    @property
    def num_attention_layers(self) -> int:
        return len(self.attention_layers)

    @cached_property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def kv_bytes_per_block_per_layer(self, block_size: int) -> int:
        """Bytes of one layer's KV of one block (all heads, keys and values)."""
        return 2 * block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @cached_property
    def conv_state_bytes(self) -> int:
        return _prod(self.conv_state_shape) * self.dtype_bytes if self.mamba_layers else 0

    @cached_property
    def ssm_state_bytes(self) -> int:
        return _prod(self.ssm_state_shape) * 4 if self.mamba_layers else 0

    @cached_property
    def mamba_bytes_per_slot(self) -> int:
        return len(self.mamba_layers) * (self.conv_state_bytes + self.ssm_state_bytes)


Span = tuple[int, int]  # [start, stop) in the whole model's numbering


@dataclass(frozen=True)
class HeadShard:
    """The heads one rank of a tensor-parallel instance keeps in its cache.

    Ranges count in the whole model's numbering. `kv_heads`: the KV heads of
    every attention layer. `mamba_heads`: the SSM heads, which are also the
    conv state's x channels (`head_dim` per head). `mamba_groups`: the conv
    state's B and C groups (`state_size` channels each). A range that other
    ranks hold too is replicated (fewer KV heads or groups than ranks).
    """

    rank: int
    size: int
    total_kv_heads: int
    kv_heads: Span
    total_mamba_heads: int = 0
    mamba_heads: Span = (0, 0)
    total_mamba_groups: int = 0
    mamba_groups: Span = (0, 0)

    def ranges(self) -> dict[str, Span]:
        return {
            "kv_heads": self.kv_heads,
            "mamba_heads": self.mamba_heads,
            "mamba_groups": self.mamba_groups,
        }


def head_shard(
    rank: int, size: int, kv_heads: int, mamba_heads: int = 0, mamba_groups: int = 0
) -> HeadShard:
    """The heads rank `rank` of `size` holds, for a model of these head counts.

    The one rule every rank's weights and cache follow: query, KV and SSM
    heads split evenly in rank order; with fewer KV heads than ranks, rank r
    keeps KV head `r * kv_heads // size` (the one its query heads read); B/C
    groups split evenly when `size` divides them, else every rank keeps all.
    """

    def even(total: int) -> Span:
        share = total // size
        return rank * share, (rank + 1) * share

    if kv_heads >= size:
        kv = even(kv_heads)
    else:
        first = rank * kv_heads // size
        kv = (first, first + 1)
    groups = mamba_group_span(mamba_groups, rank, size)
    return HeadShard(
        rank=rank,
        size=size,
        total_kv_heads=kv_heads,
        kv_heads=kv,
        total_mamba_heads=mamba_heads,
        mamba_heads=even(mamba_heads),
        total_mamba_groups=mamba_groups,
        mamba_groups=groups,
    )


def mamba_group_span(n_groups: int, rank: int, size: int) -> Span:
    """`[first, stop)` of the B/C groups rank `rank` of `size` keeps: its share
    when `n_groups` splits over the ranks, else all of them (each of its heads
    then reads its own group among them)."""
    if n_groups % size == 0:
        share = n_groups // size
        return rank * share, (rank + 1) * share
    return 0, n_groups


def _length(span: Span) -> int:
    return span[1] - span[0]


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out
