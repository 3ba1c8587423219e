"""Block gather / scatter / copy kernels against their torch twins (exact equality)."""

# ruff: noqa: E402  -- the interpreter switch must precede the kernel imports.
import os

import torch

if not torch.cuda.is_available():
    # Kernels are built when their module is imported: pick the interpreter first.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from models.kernels import block_copy
from models.kernels.block_copy import BlockLayoutError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NUM_BLOCKS, LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 9, 3, 4, 2, 8
UNORDERED_IDS = [7, 2, 5, 0]


def _v1_pool(dtype: torch.dtype) -> torch.Tensor:
    shape = (NUM_BLOCKS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, device=DEVICE).to(dtype)


def _v2_pool(dtype: torch.dtype) -> torch.Tensor:
    shape = (NUM_BLOCKS, LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, device=DEVICE).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["v1", "v2_layer_view", "v2_whole", "v2_key_view"])
def test_gather_matches_reference(dtype: torch.dtype, layout: str) -> None:
    v2 = _v2_pool(dtype)
    pool = {
        "v1": _v1_pool(dtype),
        "v2_layer_view": v2[:, 1],
        "v2_whole": v2,
        "v2_key_view": v2[:, 2, 0],
    }[layout]
    staging = block_copy.gather_blocks(pool, UNORDERED_IDS)
    assert staging.is_contiguous()
    assert staging.shape == (len(UNORDERED_IDS), *pool.shape[1:])
    assert torch.equal(staging, block_copy.gather_blocks_ref(pool, UNORDERED_IDS))
    assert torch.equal(staging, pool[torch.tensor(UNORDERED_IDS, device=DEVICE)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_writes_only_the_named_blocks_of_a_strided_view(dtype: torch.dtype) -> None:
    v2 = _v2_pool(dtype)
    staging = torch.randn(3, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=DEVICE).to(dtype)
    ids = torch.tensor([6, 1, 3], device=DEVICE, dtype=torch.int32)
    by_kernel, by_ref = v2.clone(), v2.clone()
    block_copy.scatter_blocks(by_kernel[:, 1], ids, staging)
    block_copy.scatter_blocks_ref(by_ref[:, 1], ids, staging)
    assert torch.equal(by_kernel, by_ref)
    assert torch.equal(by_kernel[1, 1], staging[1])
    untouched = torch.ones(NUM_BLOCKS, LAYERS, dtype=torch.bool)
    untouched[[6, 1, 3], 1] = False
    assert torch.equal(by_kernel[untouched], v2[untouched])


def test_gather_then_scatter_moves_blocks_between_pools() -> None:
    src, dst = (
        _v1_pool(torch.float16),
        torch.zeros(
            NUM_BLOCKS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.float16
        ),
    )
    out = torch.empty(
        len(UNORDERED_IDS) * 2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM,
        device=DEVICE,
        dtype=torch.float16,
    )
    staging = block_copy.gather_blocks(src, UNORDERED_IDS, out=out)
    assert staging is out
    block_copy.scatter_blocks(dst, [1, 8, 3, 4], staging)
    for s, d in zip(UNORDERED_IDS, [1, 8, 3, 4], strict=True):
        assert torch.equal(dst[d], src[s])
    assert not dst[[0, 2, 5, 6, 7]].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_bridges_v1_layers_and_the_v2_pool(dtype: torch.dtype) -> None:
    v1_layers = [_v1_pool(dtype) for _ in range(LAYERS)]
    v2 = torch.zeros(
        NUM_BLOCKS, LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=dtype
    )
    src_ids, dst_ids = [4, 8, 1], [2, 0, 7]
    reference = v2.clone()
    for layer, pool in enumerate(v1_layers):
        block_copy.copy_blocks(pool, src_ids, v2[:, layer], dst_ids)
        block_copy.copy_blocks_ref(pool, src_ids, reference[:, layer], dst_ids)
    assert torch.equal(v2, reference)
    assert torch.equal(v2[0, 2], v1_layers[2][8])

    back = [torch.zeros_like(pool) for pool in v1_layers]
    for layer, pool in enumerate(back):
        block_copy.copy_blocks(v2[:, layer], dst_ids, pool, src_ids)
        assert torch.equal(pool[src_ids], v1_layers[layer][src_ids])


def test_empty_id_list_is_a_no_op() -> None:
    pool = _v1_pool(torch.float32)
    before = pool.clone()
    assert block_copy.gather_blocks(pool, []).shape == (0, *pool.shape[1:])
    block_copy.scatter_blocks(pool, [], torch.empty(0, *pool.shape[1:], device=DEVICE))
    assert torch.equal(pool, before)


def test_rejects_pools_whose_rows_are_not_dense() -> None:
    transposed = _v1_pool(torch.float32).transpose(2, 3)
    with pytest.raises(BlockLayoutError, match="rows are not contiguous"):
        block_copy.gather_blocks(transposed, [1])


def test_rejects_staging_of_the_wrong_size_or_dtype() -> None:
    pool = _v1_pool(torch.float32)
    with pytest.raises(BlockLayoutError, match="contiguous tensor of 2 x"):
        block_copy.scatter_blocks(pool, [1, 2], torch.zeros(1, *pool.shape[1:], device=DEVICE))
    with pytest.raises(BlockLayoutError, match="dtype"):
        block_copy.gather_blocks(
            pool, [1], out=torch.zeros(1, *pool.shape[1:], device=DEVICE, dtype=torch.float16)
        )


def test_copy_rejects_mismatched_rows_and_id_counts() -> None:
    v1 = _v1_pool(torch.float32)
    with pytest.raises(BlockLayoutError, match="row size"):
        block_copy.copy_blocks(v1, [1], _v2_pool(torch.float32), [1])
    with pytest.raises(BlockLayoutError, match="2 source ids but 1"):
        block_copy.copy_blocks(v1, [1, 2], v1.clone(), [3])
