"""Decode-time attention over the paged KV cache (one query token per sequence).

Shapes (the contract of `models/batch.py`):

    q            [B, num_heads, head_dim]
    key_cache    [num_blocks, block_size, kv_heads, head_dim]   any strides
    value_cache  [num_blocks, block_size, kv_heads, head_dim]   any strides
    block_tables [B, max_blocks] int32/int64, padded with the null block 0
    seq_lens     [B] tokens to attend to, the current token included
    out          [B, num_heads, head_dim] in q's dtype

The caches are usually views into a larger pool, so every stride is passed to
the kernel instead of assuming contiguity:

    V1  pool[num_blocks, 2, bs, h, d]           key = pool[:, 0], value = pool[:, 1]
    V2  pool[num_blocks, L, 2, bs, h, d]        key = pool[:, l, 0], value = pool[:, l, 1]

Grouped-query attention: query head `qh` reads kv head `qh // (num_heads // kv_heads)`.
The kernel runs one program per (sequence, kv head) and serves that kv head's
whole group of query heads, so each K/V block is read once per group. A
sequence with `seq_len == 0` (a padding row) yields zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


class AttentionShapeError(ValueError):
    """Inputs of a paged-attention call disagree on shapes or dtypes."""


def check_decode_inputs(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Raise `AttentionShapeError` when the inputs break the contract above."""
    if q.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise AttentionShapeError(
            f"expected q [B, heads, dim] and equal caches [blocks, bs, kv_heads, dim]; got q "
            f"{tuple(q.shape)}, key {tuple(key_cache.shape)}, value {tuple(value_cache.shape)}"
        )
    batch, num_heads, head_dim = q.shape
    kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim or num_heads % kv_heads != 0:
        raise AttentionShapeError(
            f"q has {num_heads} heads of dim {head_dim} but the cache has {kv_heads} kv heads "
            f"of dim {key_cache.shape[3]}; heads must be a multiple of kv heads, dims equal"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise AttentionShapeError(
            f"block_tables must be [{batch}, max_blocks] and seq_lens [{batch}]; got "
            f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}"
        )
    others = (key_cache, value_cache, block_tables, seq_lens)
    if any(t.device != q.device for t in others):
        raise AttentionShapeError(
            f"q is on {q.device} but caches/tables are on {[str(t.device) for t in others]}; "
            "move them to one device"
        )
    if key_cache.dtype != value_cache.dtype:
        raise AttentionShapeError(
            f"key cache is {key_cache.dtype} but value cache is {value_cache.dtype}"
        )


# ---------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr,
    scale,
    stride_qb, stride_qh, stride_qd,
    stride_kn, stride_ks, stride_kh, stride_kd,
    stride_vn, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_oh, stride_od,
    stride_tb,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)

    g = tl.arange(0, GROUP_PAD)  # query heads of this group
    t = tl.arange(0, BLOCK_PAD)  # token offsets inside a block
    d = tl.arange(0, DIM_PAD)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM

    q_heads = kv_head * GROUP + g
    q_offs = seq * stride_qb + q_heads[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptr + q_offs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    # Fold the softmax scale into q once instead of into every score tile.
    q = q.to(tl.float32) * scale

    # Online softmax state per query head, all in float32.
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)

    num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    for j in range(0, num_blocks):
        # Physical block ids can exceed int32 offsets once multiplied by strides.
        block = tl.load(tables_ptr + seq * stride_tb + j).to(tl.int64)
        pos = j * BLOCK_SIZE + t
        t_mask = (t < BLOCK_SIZE) & (pos < seq_len)
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k_offs = (
            block * stride_kn
            + t[:, None] * stride_ks
            + kv_head * stride_kh
            + d[None, :] * stride_kd
        )
        v_offs = (
            block * stride_vn
            + t[:, None] * stride_vs
            + kv_head * stride_vh
            + d[None, :] * stride_vd
        )
        k = tl.load(k_ptr + k_offs, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + v_offs, mask=kv_mask, other=0.0).to(tl.float32)

        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, BLOCK_PAD]
        scores = tl.where(t_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    # Empty sequences (padding rows) have l_i == 0: emit zeros, not NaN.
    denom = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / denom[:, None]
    o_offs = seq * stride_ob + q_heads[:, None] * stride_oh + d[None, :] * stride_od
    tl.store(
        out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :]
    )


def paged_attention_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton paged decode attention; see the module docstring for the contract.

    `out`, when given, receives the result (any strides) and is returned.
    """
    check_decode_inputs(q, key_cache, value_cache, block_tables, seq_lens)
    batch, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = key_cache.shape
    group = num_heads // kv_heads
    result = out if out is not None else torch.empty_like(q)
    if batch == 0:
        return result
    _paged_decode_kernel[(batch, kv_heads)](
        q, key_cache, value_cache, result, block_tables, seq_lens,
        float(scale),
        *q.stride(), *key_cache.stride(), *value_cache.stride(), *result.stride(),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group),
        BLOCK_SIZE=block_size, BLOCK_PAD=triton.next_power_of_2(block_size),
        HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return result


# ---------------------------------------------------------------------------
# Plain-torch twin
# ---------------------------------------------------------------------------


def paged_attention_decode_ref(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference for `paged_attention_decode`: gather each sequence's tokens, softmax in fp32."""
    check_decode_inputs(q, key_cache, value_cache, block_tables, seq_lens)
    num_heads = q.shape[1]
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // kv_heads
    result = out if out is not None else torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            result[i].zero_()
            continue
        positions = torch.arange(seq_len, device=q.device)
        blocks = block_tables[i, positions // block_size].long()
        offsets = positions % block_size
        keys = key_cache[blocks, offsets].float()  # [seq_len, kv_heads, head_dim]
        values = value_cache[blocks, offsets].float()
        keys = keys.repeat_interleave(group, dim=1)  # query head h reads kv head h // group
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[i].float(), keys) * scale
        probs = torch.softmax(scores, dim=-1)
        result[i] = torch.einsum("ht,thd->hd", probs, values).to(result.dtype)
    return result
