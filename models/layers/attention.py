"""Grouped-query attention over the paged KV cache (plain torch).

One call serves a whole engine step: the new tokens' K/V are written through
`batch.slot_mapping`, then every query token attends causally to its
sequence's cached tokens, read back through the block table:

    seq i, block_size 4, context_lens[i] = 5, seq_lens[i] = 7 (2 new tokens)

    block_tables[i] = [7, 2, ...]   positions 0-3 in block 7, 4-7 in block 2
    keys gathered   = k0 k1 k2 k3 | k4 k5 k6 .        (5 cached + 2 just written)
    query at pos 5 sees k0..k5, query at pos 6 sees k0..k6

A decode-only step (one token per sequence) runs as one batched computation
over the longest context, masking each row past its own length (one
`scaled_dot_product_attention` call, the queries of a KV head grouped as its
query rows so K/V are never repeated per head). A step where every sequence
starts at position 0 (fresh prompts) attends over its own new K/V in one call
when the prompts are equally long (SDPA's own causal mask, which skips the
masked half), or are all short, or a sliding window applies (padded to the
longest prompt, with an explicit mask). Other steps that carry prefill chunks
run their single-token sequences (decodes continuing beside the chunks) as
one batched decode call and loop over the chunks; a chunk that starts a
prompt attends over its own new K/V with SDPA's causal mask, a chunk that
continues one reads its earlier keys back from the cache. On CPU, where the
C decode kernel serves (fp32 / bf16), a step with prompt tokens and no
sequence past 1,024 tokens skips all of that: each query token becomes a
one-query row over its sequence's cached keys up to its own position, and
the whole step is one kernel call.

Shapes: q `[T, heads, head_dim]`, k/v `[T, kv_heads, head_dim]`; query head
`h` reads kv head `h // (heads // kv_heads)`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvcache.views import AttentionLayerCache
from models.batch import DecodeRows, ForwardBatch, PaddedPrompts
from models.kernels import dispatch

# SDPA's backends on CUDA, cuDNN's left out: it builds an execution plan for
# every new shape, and a serving step's shapes keep changing (prompts x padded
# length), and a step with a new prefill shape took about ten times as long
# with it (docs/performance.md, "Attention"; not measured here yet).
_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """`F.scaled_dot_product_attention`, on CUDA without the cuDNN backend."""
    if q.is_cuda:
        with sdpa_kernel(_CUDA_SDPA_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, layer_cache: AttentionLayerCache, batch: ForwardBatch
) -> None:
    """Store the step's new K/V at `batch.slot_mapping` (block * block_size + offset).

    Indexes `[block, offset]` rather than a flattened view because the cache may
    be a strided view into a block-major pool, which cannot be flattened.
    """
    blocks, offsets = batch.slot_blocks_offsets
    layer_cache.key_cache[blocks, offsets] = k.to(layer_cache.key_cache.dtype)
    layer_cache.value_cache[blocks, offsets] = v.to(layer_cache.value_cache.dtype)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_cache: AttentionLayerCache,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Write the new K/V into the cache, then attend; returns `[T, heads, head_dim]`.

    Requires `seq_lens[i] >= 1` for every sequence and positions of sequence
    `i` to be `context_lens[i] ..< seq_lens[i]`. With `sliding_window` a query
    at position p sees keys at positions `> p - sliding_window` only.
    """
    write_kv(k, v, layer_cache, batch)
    return attend(q, k, v, layer_cache, batch, scale, sliding_window)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_cache: AttentionLayerCache,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`paged_attention` for a step whose new K/V are already in the cache."""
    if batch.is_decode_only:
        return decode_attention(q, layer_cache, batch, scale, sliding_window)
    out = _tiled_prompts_on_cpu(q, layer_cache, batch, scale, sliding_window)
    if out is not None:
        return out
    out = _per_token_decode_on_cpu(q, layer_cache, batch, scale, sliding_window)
    if out is not None:
        return out
    if _fresh_prompts_in_one_call(batch, sliding_window):
        layout = batch.padded_prefill_layout
        assert layout is not None  # every sequence starts at position 0
        return _fresh_prefill_attention(q, k, v, layout, scale, sliding_window)
    return _chunked_prefill_attention(q, k, v, layer_cache, batch, scale, sliding_window)


# Longest sequence (keys) of a step that `_per_token_decode_on_cpu` serves.
_PER_TOKEN_MAX_LEN = 1024


def _per_token_decode_on_cpu(
    q: torch.Tensor,
    layer_cache: AttentionLayerCache,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor | None:
    """A step that carries prompt tokens, on CPU where the C decode kernel
    serves: every query token is a one-query row over its own sequence's
    cached keys up to its position (`ForwardBatch.token_rows`), all in one
    kernel call; None (nothing done) elsewhere.

    The kernel reads the cache in place and keeps a kv head's group of query
    heads on one pass over its keys; against SDPA's flash kernel it took
    about half the CPU time on short prompts. Its cost per query grows with
    the keys it reads, while SDPA's tiles reuse a block of keys across many
    queries, so past `_PER_TOKEN_MAX_LEN` keys SDPA runs
    (docs/performance.md, "Attention").
    """
    if q.device.type != "cpu" or batch.max_seq_len > _PER_TOKEN_MAX_LEN:
        return None
    tables, seq_lens = batch.token_rows
    return dispatch.cpu_decode_attention(
        q, layer_cache.key_cache, layer_cache.value_cache, tables, seq_lens, scale, sliding_window
    )


# Longest sequence (keys) of a step that `_tiled_prompts_on_cpu` serves.
_TILED_MAX_LEN = 2048


def _tiled_prompts_on_cpu(
    q: torch.Tensor,
    layer_cache: AttentionLayerCache,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor | None:
    """A step with prompt chunks, on CPU: the chunks through the C prefill
    kernel (a tile of up to 16 tokens with every query head of a kv head per
    pass over the keys), the single-token sequences beside them through the
    decode kernel; None (nothing done) where the prefill kernel does not
    serve the tensors (a head dim that is not a whole number of vectors,
    fp16) or past `_TILED_MAX_LEN` keys.

    Tiled, a causal prompt of SmolLM2's attention shape beats per-token
    decode rows at every length and SDPA up to 2,048 tokens, not at 4,096,
    hence the limit (`python -m benchmarks.prefill_attention_bench`;
    docs/performance.md, "Attention").
    """
    if q.device.type != "cpu" or batch.max_seq_len > _TILED_MAX_LEN:
        return None
    chunks = batch.chunk_rows
    if chunks is None:
        return None
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    key_cache, value_cache = layer_cache.key_cache, layer_cache.value_cache
    if not dispatch.cpu_prefill_attention(
        q, key_cache, value_cache, chunks, out, scale, sliding_window
    ):
        return None
    _decode_tokens_into(out, q, layer_cache, batch, scale, sliding_window)
    return out


# A step of fresh prompts of unequal lengths runs one causal SDPA call per
# prompt once its longest prompt has this many tokens: a padded batch computes
# every padded and every masked score, per-prompt causal calls skip both, and
# past ~32 tokens that saves more than the extra calls cost
# (docs/performance.md, "Attention").
_PER_PROMPT_MIN_LEN = 32


def _fresh_prompts_in_one_call(batch: ForwardBatch, sliding_window: int | None) -> bool:
    """Whether a step of fresh prompts runs as one (padded) SDPA call; see the
    module docstring."""
    shape = batch.shape
    if shape.has_cached_tokens:
        return False
    equal_lengths = batch.num_tokens == batch.num_seqs * shape.max_seq_len
    return sliding_window is not None or equal_lengths or shape.max_seq_len < _PER_PROMPT_MIN_LEN


def decode_attention(
    q: torch.Tensor,
    layer_cache: AttentionLayerCache,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One query per sequence, batched: q `[B, heads, head_dim]` -> same shape.

    The fused paged-decode kernel takes over wherever `models.kernels.dispatch`
    runs Triton (CUDA tensors), and its C kernel on CPU (fp32/bf16, which reads
    the cache in place); the vectorized torch code in `_batched_decode` serves the cases
    neither covers (sliding window on CUDA, cache dtype != q dtype, fp16 on CPU).
    """
    return _batched_decode(
        q, layer_cache, batch.all_seq_rows, batch.block_size, scale, sliding_window
    )


def _batched_decode(
    q: torch.Tensor,
    layer_cache: AttentionLayerCache,
    rows: DecodeRows,
    block_size: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """`decode_attention` for the sequences `rows` describes; q `[n, heads, head_dim]`."""
    num_seqs, num_heads, head_dim = q.shape
    key_cache, value_cache = layer_cache.key_cache, layer_cache.value_cache
    tables, seq_lens = rows.block_tables, rows.seq_lens
    if sliding_window is None and q.dtype == key_cache.dtype and dispatch.use_triton(q.device):
        return dispatch.paged_attention_decode(q, key_cache, value_cache, tables, seq_lens, scale)
    out = dispatch.cpu_decode_attention(
        q, key_cache, value_cache, tables, seq_lens, scale, sliding_window
    )
    if out is not None:
        return out
    kv_heads = key_cache.shape[2]
    num_blocks = -(-rows.max_seq_len // block_size)
    # index_select over the flattened table: several times faster on CPU than
    # advanced indexing of the (strided) cache view.
    blocks = tables[:, :num_blocks].reshape(-1)
    span = num_blocks * block_size

    def gather(cache: torch.Tensor) -> torch.Tensor:
        """`[B, kv_heads, span, d]`: a KV head is SDPA's head and its
        `heads // kv_heads` queries are SDPA's query rows. Blocks are gathered
        as the pool holds them (a `[bs, d]` tile per kv head)."""
        picked = cache.transpose(1, 2).index_select(0, blocks)
        picked = picked.view(num_seqs, num_blocks, kv_heads, block_size, head_dim)
        return picked.transpose(1, 2).reshape(num_seqs, kv_heads, span, head_dim)

    keys, values = gather(key_cache), gather(value_cache)
    grouped = q.view(num_seqs, kv_heads, num_heads // kv_heads, head_dim)
    key_pos = torch.arange(span, device=q.device)[None, :]
    last = (seq_lens - 1)[:, None]
    visible = key_pos <= last
    if sliding_window is not None:
        visible &= key_pos > last - sliding_window
    out = sdpa(
        grouped,
        keys.to(q.dtype),
        values.to(q.dtype),
        attn_mask=visible[:, None, None, :],
        scale=scale,
    )
    return out.reshape(num_seqs, num_heads, head_dim)


def _decode_tokens_into(
    out: torch.Tensor,
    q: torch.Tensor,
    layer_cache: AttentionLayerCache,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None,
) -> None:
    """The single-token sequences of a step with prompt chunks (decodes
    continuing beside them), in one batched decode call, into their rows of `out`."""
    decodes = batch.decode_rows
    if decodes is not None:
        out[decodes.token_rows] = _batched_decode(
            q[decodes.token_rows], layer_cache, decodes, batch.block_size, scale, sliding_window
        )


def gather_kv(
    layer_cache: AttentionLayerCache, block_table: torch.Tensor, num_tokens: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[num_tokens, kv_heads, head_dim]` of one sequence's first tokens."""
    blocks = block_table[: -(-num_tokens // block_size)]
    kv_heads, head_dim = layer_cache.key_cache.shape[2:]
    keys = layer_cache.key_cache[blocks].reshape(-1, kv_heads, head_dim)[:num_tokens]
    values = layer_cache.value_cache[blocks].reshape(-1, kv_heads, head_dim)[:num_tokens]
    return keys, values


def _fresh_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: PaddedPrompts,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Every sequence starts at position 0, so its keys are this step's own
    K/V: one padded SDPA call `[B, heads, L, d]` instead of a loop."""
    rows, valid = layout.rows, layout.valid
    num_seqs, width = valid.shape
    if rows is None:  # equal lengths: no padding, no gather
        q_p, k_p, v_p = (
            t.reshape(num_seqs, width, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)
        )
        if sliding_window is None:
            # SDPA's top-left causal mask is ours, and its kernel skips the masked half.
            out = sdpa(
                q_p, k_p.to(q.dtype), v_p.to(q.dtype), is_causal=True, scale=scale, enable_gqa=True
            )
            return out.transpose(1, 2).reshape(q.shape)
    else:
        q_p, k_p, v_p = (t[rows].transpose(1, 2) for t in (q, k, v))
    pos = torch.arange(width, device=q.device)
    visible = pos[None, :] <= pos[:, None]
    if sliding_window is not None:
        visible &= pos[None, :] > pos[:, None] - sliding_window
    # Padded query rows still see key 0, so no row is all -inf; they are dropped.
    mask = visible[None, None, :, :] & valid[:, None, None, :]
    out = sdpa(q_p, k_p.to(q.dtype), v_p.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True)
    out = out.transpose(1, 2)
    if rows is None or layout.token_slots is None:
        return out.reshape(q.shape)
    return out.reshape(num_seqs * width, *q.shape[1:]).index_select(0, layout.token_slots)


def _chunked_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_cache: AttentionLayerCache,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Single-token sequences (decodes continuing beside the chunks) in one
    batched decode call; each prompt chunk on its own, over its own new K/V
    (`k`, `v`) when it starts the prompt, else over the cache."""
    out = torch.empty_like(q)
    _decode_tokens_into(out, q, layer_cache, batch, scale, sliding_window)
    # Host copies of the counts: slicing by them reads nothing back from the
    # device. The loop stays: a step holds few chunks (the scheduler's token
    # budget), and one padded call would gather every chunk's keys to the
    # longest context, the whole-context gather `kvcache.gpu_share` reserves for
    # once (`attention_gather_bytes`), times the number of chunks.
    starts, context_lens = batch.shape.query_start_loc, batch.shape.context_lens
    seq_lens = batch.shape.seq_lens
    for i in batch.shape.chunk_seqs:
        start, end = starts[i], starts[i + 1]
        if context_lens[i] == 0:
            keys, values = k[start:end], v[start:end]
        else:
            keys, values = gather_kv(
                layer_cache, batch.block_tables[i], seq_lens[i], batch.block_size
            )
        out[start:end] = _causal_attention(
            q[start:end],
            keys.to(q.dtype),
            values.to(q.dtype),
            context_lens[i],
            scale,
            sliding_window,
        )
    return out


def _causal_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    context_len: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Queries `[n, heads, d]` at positions `context_len ..< context_len + n`
    over keys/values `[context_len + n, kv_heads, d]`."""
    num_queries = q.shape[0]
    num_keys = keys.shape[0]
    # [1, heads, n, d] / [1, kv_heads, S, d]: SDPA's GQA maps query head h to
    # kv head h // (heads // kv_heads), as this module does.
    q_h, k_h, v_h = (t.transpose(0, 1).unsqueeze(0) for t in (q, keys, values))
    if sliding_window is None and context_len == 0:
        # Queries and keys start together: SDPA's top-left causal mask is ours.
        out = sdpa(q_h, k_h, v_h, is_causal=True, scale=scale, enable_gqa=True)
    else:
        query_pos = torch.arange(context_len, context_len + num_queries, device=q.device)[:, None]
        key_pos = torch.arange(num_keys, device=q.device)[None, :]
        visible = key_pos <= query_pos
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window
        out = sdpa(q_h, k_h, v_h, attn_mask=visible, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
