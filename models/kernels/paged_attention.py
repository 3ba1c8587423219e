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

    V1  pool[num_blocks, h, 2, bs, d]           key = pool[:, :, 0].transpose(1, 2)
    V2  pool[num_blocks, h, L, 2, bs, d]        key = pool[:, :, l, 0].transpose(1, 2)

(head-outer blocks, see `kvcache.pool_layout`: a kv head's keys of a block
are one contiguous `[bs, d]` tile, which is what a program here reads).

Grouped-query attention: query head `qh` reads kv head `qh // (num_heads // kv_heads)`.
The kernel runs one program per (sequence, kv head, split of the keys) and
serves that kv head's whole group of query heads with matrix products, so
each K/V tile is read once per group; long contexts split their keys over
several programs whose partial softmax sums a second kernel merges. A
sequence with `seq_len == 0` (a padding row) yields zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


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
#
# Grid (sequence, kv head, split). A program takes the split's share of the
# sequence's keys in tiles of TILE tokens (a tile may span several cache
# blocks: each token finds its block through the table) and runs an online
# softmax for the whole query group at once:
#
#     scores [GROUP_PAD, TILE]     = q [GROUP_PAD, D] @ k^T [D, TILE]     (tl.dot)
#     acc    [GROUP_PAD, D]       += p [GROUP_PAD, TILE] @ v [TILE, D]    (tl.dot)
#
# With one split the program normalizes and writes the output. With several
# (split-K, for long contexts or too few sequences to fill the GPU) each
# writes its running max m, sum l and unnormalized acc, and `_reduce_kernel`
# merges them per query head:
#
#     M = max_s m_s    out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s

_MIN_DOT = 16  # tl.dot needs every dimension to be at least 16
_TARGET_PROGRAMS = 264  # about two waves of programs on a 132-SM GPU
_MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more to merge than it saves
_MAX_SPLITS = 16


# The table's row stride (its width), the keys per split and the split count
# change from step to step (with the batch and the longest context); as
# constants, or specialized on (== 1, % 16), they would compile a new variant
# (a stall of a step; docs/performance.md) in the middle of serving. Only
# whether the keys are split at all is a constant: the warm-up compiles both.
@triton.jit(do_not_specialize=["split_tokens", "num_splits", "stride_tb"])
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,
    scale, split_tokens, num_splits,
    stride_qb, stride_qh, stride_qd,
    stride_kn, stride_ks, stride_kh, stride_kd,
    stride_vn, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_oh, stride_od,
    stride_tb, stride_tc,
    NUM_HEADS: tl.constexpr, SPLIT: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    start = split * split_tokens
    end = tl.minimum(seq_len, start + split_tokens)

    g = tl.arange(0, GROUP_PAD)  # query heads of this group
    t = tl.arange(0, TILE)  # token offsets inside a tile
    d = tl.arange(0, DIM_PAD)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM

    q_heads = kv_head * GROUP + g
    q_offs = seq * stride_qb + q_heads[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptr + q_offs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Online softmax state per query head, all in float32.
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)

    for tile_start in range(start, end, TILE):
        pos = tile_start + t
        t_mask = pos < end
        # Physical block ids can exceed int32 offsets once multiplied by strides.
        block = tl.load(
            tables_ptr + seq * stride_tb + (pos // BLOCK_SIZE) * stride_tc, mask=t_mask, other=0
        ).to(tl.int64)
        offset = pos % BLOCK_SIZE
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k_offs = (
            block[:, None] * stride_kn
            + offset[:, None] * stride_ks
            + kv_head * stride_kh
            + d[None, :] * stride_kd
        )
        v_offs = (
            block[:, None] * stride_vn
            + offset[:, None] * stride_vs
            + kv_head * stride_vh
            + d[None, :] * stride_vd
        )
        k = tl.load(k_ptr + k_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + v_offs, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(t_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if not SPLIT:
        # Empty sequences (padding rows) have l_i == 0: emit zeros, not NaN.
        denom = tl.where(l_i > 0.0, l_i, 1.0)
        o_offs = seq * stride_ob + q_heads[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(
            out_ptr + o_offs,
            (acc / denom[:, None]).to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        # Partials [B, NUM_HEADS, num_splits] (m, l) and [..., DIM_PAD] (acc), contiguous.
        row = (seq * NUM_HEADS + q_heads) * num_splits + split
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * DIM_PAD + d[None, :], acc, mask=g_mask[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, num_splits,
    stride_ob, stride_oh, stride_od,
    NUM_HEADS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    s_mask = s < num_splits
    rows = (seq * NUM_HEADS + head) * num_splits + s
    m = tl.load(part_m_ptr + rows, mask=s_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + rows, mask=s_mask, other=0.0)  # noqa: E741
    acc = tl.load(
        part_acc_ptr + rows[:, None] * DIM_PAD + d[None, :], mask=s_mask[:, None], other=0.0
    )
    m_max = tl.max(m, axis=0)
    # An empty sequence has every m == -inf: weigh nothing, emit zeros.
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_max)
    total = tl.sum(l * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def num_splits_for(batch: int, kv_heads: int, max_tokens: int) -> int:
    """How many programs share one sequence's keys: enough to fill the GPU
    when few sequences run, never fewer than `_MIN_SPLIT_TOKENS` keys each.

    Depends on shapes only (the table width, not the lengths), so it never
    reads the device and a captured graph keeps its split count. The model
    runner's warm-up (`ModelRunner.prepare`) compiles both variants.
    """
    by_length = triton.cdiv(max_tokens, _MIN_SPLIT_TOKENS)
    by_occupancy = triton.cdiv(_TARGET_PROGRAMS, max(batch * kv_heads, 1))
    return max(1, min(by_length, by_occupancy, _MAX_SPLITS))


def paged_attention_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton paged decode attention; see the module docstring for the contract.

    `out`, when given, receives the result (any strides) and is returned.
    `num_splits` overrides the split-K choice of `num_splits_for`.
    """
    check_decode_inputs(q, key_cache, value_cache, block_tables, seq_lens)
    batch, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = key_cache.shape
    group = num_heads // kv_heads
    result = out if out is not None else torch.empty_like(q)
    if batch == 0:
        return result
    tile = max(_MIN_DOT, triton.next_power_of_2(block_size))
    dim_pad = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    max_tokens = block_tables.shape[1] * block_size
    splits = num_splits or num_splits_for(batch, kv_heads, max_tokens)
    # Each split covers whole tiles; the last ones may get nothing.
    split_tokens = triton.cdiv(triton.cdiv(max(max_tokens, 1), splits), tile) * tile
    # The interpreter's bf16 tl.dot returns garbage (triton 3.9, CPU): products
    # run in fp32 there. Compiled kernels take bf16 operands as they are.
    upcast = q.dtype == torch.bfloat16 and isinstance(_paged_decode_kernel, InterpretedFunction)
    if splits > 1:
        part_m = torch.empty(batch, num_heads, splits, device=q.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(*part_m.shape, dim_pad, device=q.device, dtype=torch.float32)
    else:  # unused: any tensor serves as the pointer
        part_m = part_l = part_acc = result
    _paged_decode_kernel[(batch, kv_heads, splits)](
        q, key_cache, value_cache, result, block_tables, seq_lens,
        part_m, part_l, part_acc,
        float(scale), split_tokens, splits,
        *q.stride(), *key_cache.stride(), *value_cache.stride(), *result.stride(),
        *block_tables.stride(),
        NUM_HEADS=num_heads, SPLIT=splits > 1,
        GROUP=group, GROUP_PAD=max(_MIN_DOT, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size, TILE=tile,
        HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        # fp32 caches keep fp32 products (TF32 would cost the 1e-4 parity).
        PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast,
    )  # fmt: skip
    if splits > 1:
        _reduce_kernel[(batch, num_heads)](
            result, part_m, part_l, part_acc, splits,
            *result.stride(),
            NUM_HEADS=num_heads,
            # One variant for every split count the chooser makes.
            SPLITS_PAD=triton.next_power_of_2(max(splits, _MAX_SPLITS)),
            HEAD_DIM=head_dim, DIM_PAD=dim_pad,
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
