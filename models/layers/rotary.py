"""Rotary position embedding (neox style, as Hugging Face Llama applies it).

Inverse frequencies follow `transformers`' `ROPE_INIT_FUNCTIONS` for the
scaling types real Llama checkpoints use:

- default: `1 / theta^(2i / dim)`
- `linear`: default divided by `factor`
- `dynamic` (NTK): `theta` grows once the sequence exceeds
  `max_position_embeddings`; as in `transformers`, the length is the largest
  position in the step plus one, so it changes nothing within the trained context
- `llama3`: low frequencies divided by `factor`, high ones kept, a smooth ramp
  between `original_max_position_embeddings / high_freq_factor` and
  `/ low_freq_factor` wavelengths

The first `rotary_dim = head_dim * partial_rotary_factor` channels rotate; the
halves `[0, rotary_dim/2)` and `[rotary_dim/2, rotary_dim)` form the pairs.
"""

from __future__ import annotations

import math

import torch

from models.config import RopeConfig


def rotary_dim(head_dim: int, rope: RopeConfig) -> int:
    return int(head_dim * rope.partial_rotary_factor)


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    # On the CPU whatever the default device (`cos_sin` moves it to the
    # step's): under the meta device of the serve command's checkpoint check,
    # these ops would run torch._refs code, whose first call imports
    # torch._dynamo (seconds of every start).
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    return 1.0 / (theta**exponents)


def llama3_inv_freq(rope: RopeConfig, dim: int, max_position_embeddings: int) -> torch.Tensor:
    inv_freq = default_inv_freq(rope.theta, dim)
    old_context = rope.original_max_position_embeddings or max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def dynamic_ntk_inv_freq(
    rope: RopeConfig, dim: int, max_position_embeddings: int, seq_len: int
) -> torch.Tensor:
    seq_len = max(seq_len, max_position_embeddings)
    growth = rope.factor * seq_len / max_position_embeddings - (rope.factor - 1)
    return default_inv_freq(rope.theta * growth ** (dim / (dim - 2)), dim)


def compute_inv_freq(
    rope: RopeConfig, dim: int, max_position_embeddings: int, seq_len: int | None = None
) -> torch.Tensor:
    """Float32 inverse frequencies `[dim // 2]` for `rope` (see module docstring)."""
    if rope.scaling_type is None:
        return default_inv_freq(rope.theta, dim)
    if rope.scaling_type == "linear":
        return default_inv_freq(rope.theta, dim) / rope.factor
    if rope.scaling_type == "llama3":
        return llama3_inv_freq(rope, dim, max_position_embeddings)
    if rope.scaling_type == "dynamic":
        return dynamic_ntk_inv_freq(rope, dim, max_position_embeddings, seq_len or 0)
    raise ValueError(
        f"rope scaling type {rope.scaling_type!r} is not implemented; "
        "use None, 'linear', 'dynamic' or 'llama3'"
    )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# Positions the first cos/sin table covers; it doubles past the longest step.
_MIN_TABLE_POSITIONS = 4096


class RotaryEmbedding(torch.nn.Module):
    """Computes `(cos, sin)` for token positions; `apply_rotary` rotates q/k with them.

    The values of positions `0 ..< n` are computed once into a table and each
    step gathers its positions' rows: the same numbers as computing them per
    step (elementwise, from the same inverse frequencies), without the
    transcendentals. The table grows (doubling) when a step's `seq_len`
    passes it; a replaced table stays referenced, since CUDA graphs captured
    before keep reading its memory. Steps past the trained context under
    dynamic scaling, whose frequencies depend on the step, are computed
    directly.
    """

    def __init__(self, head_dim: int, rope: RopeConfig, max_position_embeddings: int) -> None:
        super().__init__()
        self.rope = rope
        self.dim = rotary_dim(head_dim, rope)
        self.max_position_embeddings = max_position_embeddings
        # A plain attribute, not a buffer: derived from the config (never in a
        # checkpoint) and kept in float32 when the model is cast to bf16/fp16.
        self.inv_freq = compute_inv_freq(rope, self.dim, max_position_embeddings)
        # (cos, sin), each `[n, rotary_dim]`, for positions 0 ..< n; not a buffer
        # either. The last one of a dtype and device is its current one.
        self._tables: list[tuple[torch.Tensor, torch.Tensor]] = []

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, seq_len: int | None = None
    ) -> tuple[torch.Tensor, ...]:
        """`(cos, sin)`, each `[T, rotary_dim]` in `dtype`, for positions `[T]`.

        `seq_len` (the largest position + 1, known on the host) bounds the
        positions for the table and serves dynamic scaling; without it the
        values are computed for these positions alone (and, under dynamic
        scaling, the positions are read back from the device).
        """
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        inv_freq = self.inv_freq
        if seq_len is not None and not self._rescaled(seq_len):
            cos, sin = self._table_for(seq_len, dtype)
            return cos.index_select(0, positions), sin.index_select(0, positions)
        if self.rope.scaling_type == "dynamic" and positions.numel():
            if seq_len is None:
                seq_len = int(positions.max()) + 1
            if self._rescaled(seq_len):
                inv_freq = compute_inv_freq(
                    self.rope, self.dim, self.max_position_embeddings, seq_len
                ).to(inv_freq.device)
        return _cos_sin(positions, inv_freq, dtype)

    def _rescaled(self, seq_len: int) -> bool:
        """Whether dynamic scaling changes the frequencies of a step this long."""
        return self.rope.scaling_type == "dynamic" and seq_len > self.max_position_embeddings

    def _table_for(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.inv_freq.device
        kind = [t for t in self._tables if (t[0].dtype, t[0].device) == (dtype, device)]
        table = kind[-1] if kind else None
        if table is not None and table[0].shape[0] >= seq_len:
            return table
        length = max(seq_len, _MIN_TABLE_POSITIONS, 2 * table[0].shape[0] if table else 0)
        if self.rope.scaling_type == "dynamic":  # the frequencies hold up to the trained context
            length = min(length, self.max_position_embeddings)
        table = _cos_sin(torch.arange(length, device=device), self.inv_freq, dtype)
        self._tables.append(table)
        return table


def _cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[T, heads, head_dim]` by `cos`/`sin` `[T, rotary_dim]`."""
    dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :dim], x[..., dim:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
