"""The per-step input of every model: flattened tokens plus cache addressing.

The engine's model runner builds one `ForwardBatch` per step; models read it
and never allocate cache memory themselves. A step mixes prefill chunks and
single decode tokens: sequence `i` contributes the tokens
`input_ids[query_start_loc[i]:query_start_loc[i + 1]]`, at positions
`context_lens[i] ..< seq_lens[i]`.

Paged KV addressing (block_size = 4 in the sketch):

    block_tables[i] = [7, 2, 0, 0]     # logical block j of seq i -> physical block
    token at position p of seq i lives in block block_tables[i][p // 4], offset p % 4
    slot_mapping[t] = physical_block * block_size + offset   (for each new token t)

Physical block 0 is the permanent null block; tables are padded with it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass
class AttentionLayerCache:
    """One attention layer's paged KV: both `[num_blocks, block_size, kv_heads, head_dim]`.

    The tensors may be strided views into a larger pool (V1 per-layer tensor or
    the V2 block-major buffer); writes through them land in the pool.
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor


@dataclass
class MambaLayerCache:
    """One Mamba layer's state pool, indexed by slot.

    conv_state: `[num_slots, conv_dim, conv_kernel - 1]` in the model dtype.
    ssm_state: `[num_slots, num_heads, head_dim, state_size]` in float32.
    """

    conv_state: torch.Tensor
    ssm_state: torch.Tensor


@dataclass
class CacheViews:
    """Caches by ordinal: `attention[k]` serves the k-th attention layer of
    `CacheSpec.attention_layers`, `mamba[k]` the k-th Mamba layer."""

    attention: list[AttentionLayerCache]
    mamba: list[MambaLayerCache]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int64, cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int64, tokens in cache after this step
    context_lens: torch.Tensor  # [B] int64, tokens already in cache before this step
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    slot_mapping: torch.Tensor  # [T] int64
    block_size: int
    mamba_slots: torch.Tensor | None = None  # [B] int64 slot per sequence (hybrid models)
    logits_indices: torch.Tensor | None = None  # [N] rows of the hidden states to turn into logits
    # Image placeholder tokens: row `image_rows[i]` of the step takes embedding
    # `image_embeds[i]` instead of its token's (VL models; None without images).
    image_rows: torch.Tensor | None = None  # [M] int64
    image_embeds: torch.Tensor | None = None  # [M, hidden_size]

    def input_embeddings(self, embedding: torch.nn.Embedding) -> torch.Tensor:
        """`[T, hidden]` token embeddings, image rows replaced by their embeddings."""
        hidden = embedding(self.input_ids)
        if self.image_rows is not None and self.image_embeds is not None:
            hidden[self.image_rows] = self.image_embeds.to(hidden.dtype)
        return hidden

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def is_decode_only(self) -> bool:
        return self.num_tokens == self.num_seqs

    # Derived once per step and shared by every attention layer. The batch is
    # never mutated after the runner builds it, so caching is safe.

    @functools.cached_property
    def slot_blocks_offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(block, offset)` of every new token's slot: `slot_mapping` split."""
        blocks = torch.div(self.slot_mapping, self.block_size, rounding_mode="floor")
        return blocks, self.slot_mapping - blocks * self.block_size

    @functools.cached_property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max()) if self.num_seqs else 0

    @functools.cached_property
    def padded_prefill_layout(self) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """For a step whose every sequence starts at position 0 (whole prompts
        or first chunks): `(rows, valid)`, both `[B, L]` with `L` the longest
        chunk; `rows[i, j]` is the flattened token index of position `j` of
        sequence `i` (0 where padded) and `valid[i, j]` is `j < seq_lens[i]`.
        `rows` is None when every chunk has length `L` (the tokens then
        reshape to `[B, L]` as they are). None when some sequence already has
        tokens in the cache."""
        if self.num_seqs == 0 or bool(self.context_lens.any()):
            return None
        width = self.max_seq_len
        cols = torch.arange(width, device=self.seq_lens.device)[None, :]
        valid = cols < self.seq_lens[:, None]
        if self.num_tokens == self.num_seqs * width:
            return None, valid
        rows = torch.where(valid, self.query_start_loc[:-1, None] + cols, 0)
        return rows, valid
