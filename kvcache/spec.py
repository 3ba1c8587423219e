"""What a model needs from the cache: the shapes the managers lay out.

`CacheSpec` is the one contract between `models/` (which derives it from a
model config) and `kvcache/` (which sizes and lays out pools from it). It is
pure Python so the bookkeeping never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    """

    num_kv_heads: int
    head_dim: int
    attention_layers: tuple[int, ...]
    dtype: str = "float32"
    mamba_layers: tuple[int, ...] = ()
    conv_state_shape: tuple[int, ...] = ()
    ssm_state_shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(
                f"unsupported cache dtype {self.dtype!r}; use one of {sorted(DTYPE_BYTES)}"
            )

    @property
    def is_hybrid(self) -> bool:
        return bool(self.mamba_layers)

    @property
    def num_attention_layers(self) -> int:
        return len(self.attention_layers)

    @cached_property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def kv_bytes_per_block_per_layer(self, block_size: int) -> int:
        """Bytes of one `[2, block_size, kv_heads, head_dim]` segment."""
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


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out
