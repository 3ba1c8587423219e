"""Block gather / scatter / copy over a cache pool whose first dim is the block id.

A *pool* here is any tensor `[num_blocks, ...]` whose per-block region
`pool[b]` is contiguous; `pool.stride(0)` may be larger than the region, so
strided views work as long as each block's row is dense:

    V1 per-layer pool    [num_blocks, ...] one layer's blocks
    V2 block-major pool  [num_blocks, ...] every layer's KV of a block
    a layer of a pool    v2_pool[:, layer]          -> rows of one layer, stride(0) = L * row
    Mamba slot pool      [num_slots, ...]

The kernels treat the pool as `[num_blocks, row_elems]` with a row stride:

    element e of block b  ->  pool_ptr + b * stride(0) + e

`copy_blocks` moves rows between two pools with the same row size, which is
how a V1 layer's blocks map into a V2 layer view (and back): one call per
layer, `copy_blocks(v1_pools[l], ids, v2_pool[:, l], ids2)`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

# Elements each program moves per row tile; 1024 keeps the tile in registers
# on every GPU generation while giving wide vectorized loads.
_TILE = 1024

BlockIds = torch.Tensor | Sequence[int]


class BlockLayoutError(ValueError):
    """A pool, staging tensor or id list does not fit the block-row contract."""


def row_elems(pool: torch.Tensor) -> int:
    """Elements in one block's region `pool[b]`."""
    return math.prod(pool.shape[1:])


def check_pool(pool: torch.Tensor, name: str = "pool") -> None:
    """Raise `BlockLayoutError` unless each `pool[b]` is one dense region."""
    if pool.dim() < 1:
        raise BlockLayoutError(f"{name} must have a leading block dimension; got a scalar")
    expected = 1
    for size, stride in zip(reversed(pool.shape[1:]), reversed(pool.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            raise BlockLayoutError(
                f"{name} rows are not contiguous (shape {tuple(pool.shape)}, strides "
                f"{pool.stride()}); pass a pool whose per-block region pool[b] is dense"
            )
        expected *= size


def as_id_tensor(block_ids: BlockIds, device: torch.device) -> torch.Tensor:
    """Block ids as an int64 tensor on `device`."""
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
            raise BlockLayoutError(
                f"block ids must be a 1-D int32/int64 tensor; got {block_ids.dtype} "
                f"of shape {tuple(block_ids.shape)}"
            )
        return block_ids.to(device=device, dtype=torch.int64)
    return torch.tensor(list(block_ids), dtype=torch.int64, device=device)


def _staging_shape(pool: torch.Tensor, num_ids: int) -> tuple[int, ...]:
    return (num_ids, *pool.shape[1:])


def _check_staging(pool: torch.Tensor, staging: torch.Tensor, num_ids: int) -> None:
    if staging.device != pool.device:
        raise BlockLayoutError(f"staging is on {staging.device} but the pool on {pool.device}")
    if staging.dtype != pool.dtype:
        raise BlockLayoutError(f"staging dtype {staging.dtype} differs from pool {pool.dtype}")
    if not staging.is_contiguous() or staging.numel() != num_ids * row_elems(pool):
        raise BlockLayoutError(
            f"staging must be a contiguous tensor of {num_ids} x {row_elems(pool)} elements "
            f"(shape {_staging_shape(pool, num_ids)}); got shape {tuple(staging.shape)}"
        )


# ---------------------------------------------------------------------------
# Triton kernel: one program per (id pair, row tile).
# ---------------------------------------------------------------------------


@triton.jit
def _copy_rows_kernel(
    src_ptr,
    src_ids_ptr,
    src_row_stride,
    dst_ptr,
    dst_ids_ptr,
    dst_row_stride,
    row_elems,
    SRC_INDEXED: tl.constexpr,
    DST_INDEXED: tl.constexpr,
    TILE: tl.constexpr,
):
    pair = tl.program_id(0)
    tile = tl.program_id(1)
    # Rows are addressed in int64: a V2 pool easily exceeds 2**31 elements.
    src_row = tl.load(src_ids_ptr + pair).to(tl.int64) if SRC_INDEXED else pair.to(tl.int64)
    dst_row = tl.load(dst_ids_ptr + pair).to(tl.int64) if DST_INDEXED else pair.to(tl.int64)
    offs = tile.to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = offs < row_elems
    vals = tl.load(src_ptr + src_row * src_row_stride + offs, mask=mask)
    tl.store(dst_ptr + dst_row * dst_row_stride + offs, vals, mask=mask)


def _launch(
    src: torch.Tensor,
    src_ids: torch.Tensor | None,
    src_row_stride: int,
    dst: torch.Tensor,
    dst_ids: torch.Tensor | None,
    dst_row_stride: int,
    num_rows: int,
    elems: int,
) -> None:
    if num_rows == 0 or elems == 0:
        return
    # The unindexed side gets the other side's ids as a placeholder pointer;
    # its constexpr branch never reads it.
    src_index = src_ids if src_ids is not None else dst_ids
    dst_index = dst_ids if dst_ids is not None else src_ids
    grid = (num_rows, triton.cdiv(elems, _TILE))
    _copy_rows_kernel[grid](
        src,
        src_index,
        src_row_stride,
        dst,
        dst_index,
        dst_row_stride,
        elems,
        SRC_INDEXED=src_ids is not None,
        DST_INDEXED=dst_ids is not None,
        TILE=_TILE,
    )


def gather_blocks(
    pool: torch.Tensor, block_ids: BlockIds, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy `pool[block_ids]` into a contiguous staging tensor `[n, *pool.shape[1:]]`.

    `out`, when given, must be contiguous with that many elements and the pool dtype.
    """
    check_pool(pool)
    ids = as_id_tensor(block_ids, pool.device)
    staging = (
        out
        if out is not None
        else torch.empty(_staging_shape(pool, ids.numel()), dtype=pool.dtype, device=pool.device)
    )
    _check_staging(pool, staging, ids.numel())
    elems = row_elems(pool)
    _launch(pool, ids, pool.stride(0), staging, None, elems, ids.numel(), elems)
    return staging


def scatter_blocks(pool: torch.Tensor, block_ids: BlockIds, staging: torch.Tensor) -> None:
    """Write row `i` of the contiguous `staging` into `pool[block_ids[i]]`, in place."""
    check_pool(pool)
    ids = as_id_tensor(block_ids, pool.device)
    _check_staging(pool, staging, ids.numel())
    elems = row_elems(pool)
    _launch(staging, None, elems, pool, ids, pool.stride(0), ids.numel(), elems)


def copy_blocks(src: torch.Tensor, src_ids: BlockIds, dst: torch.Tensor, dst_ids: BlockIds) -> None:
    """`dst[dst_ids[i]] = src[src_ids[i]]` for every i; pools need equal row size and dtype."""
    check_pool(src, "src")
    check_pool(dst, "dst")
    sids = as_id_tensor(src_ids, src.device)
    dids = as_id_tensor(dst_ids, dst.device)
    _check_copy(src, sids, dst, dids)
    _launch(src, sids, src.stride(0), dst, dids, dst.stride(0), sids.numel(), row_elems(src))


def _check_copy(
    src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    if src.device != dst.device:
        raise BlockLayoutError(
            f"copy_blocks moves within one device; src is on {src.device}, dst on {dst.device}"
        )
    if src.dtype != dst.dtype or row_elems(src) != row_elems(dst):
        raise BlockLayoutError(
            f"copy_blocks needs equal dtype and row size; src is {src.dtype} x {row_elems(src)}, "
            f"dst is {dst.dtype} x {row_elems(dst)}"
        )
    if src_ids.numel() != dst_ids.numel():
        raise BlockLayoutError(
            f"copy_blocks got {src_ids.numel()} source ids but {dst_ids.numel()} destination ids"
        )


# ---------------------------------------------------------------------------
# Plain-torch twins: the semantics the kernels must match.
# ---------------------------------------------------------------------------


def gather_blocks_ref(
    pool: torch.Tensor, block_ids: BlockIds, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Reference for `gather_blocks`."""
    check_pool(pool)
    ids = as_id_tensor(block_ids, pool.device)
    staging = (
        out
        if out is not None
        else torch.empty(_staging_shape(pool, ids.numel()), dtype=pool.dtype, device=pool.device)
    )
    _check_staging(pool, staging, ids.numel())
    staging.view(_staging_shape(pool, ids.numel())).copy_(pool.index_select(0, ids))
    return staging


def scatter_blocks_ref(pool: torch.Tensor, block_ids: BlockIds, staging: torch.Tensor) -> None:
    """Reference for `scatter_blocks`."""
    check_pool(pool)
    ids = as_id_tensor(block_ids, pool.device)
    _check_staging(pool, staging, ids.numel())
    # index_copy_ writes through strided views, unlike pool[ids] = ... on a copy.
    pool.index_copy_(0, ids, staging.view(_staging_shape(pool, ids.numel())))


def copy_blocks_ref(
    src: torch.Tensor, src_ids: BlockIds, dst: torch.Tensor, dst_ids: BlockIds
) -> None:
    """Reference for `copy_blocks`."""
    check_pool(src, "src")
    check_pool(dst, "dst")
    sids = as_id_tensor(src_ids, src.device)
    dids = as_id_tensor(dst_ids, dst.device)
    _check_copy(src, sids, dst, dids)
    rows = src.index_select(0, sids).reshape(sids.numel(), -1)
    dst.index_copy_(0, dids, rows.view(_staging_shape(dst, dids.numel())))
