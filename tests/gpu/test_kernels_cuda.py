"""The Triton kernels compiled for CUDA, at serving-sized shapes, against their torch twins."""

import pytest
import torch

from models.kernels import block_copy, dispatch
from models.kernels.mamba_state_update import mamba_state_update, mamba_state_update_ref
from models.kernels.paged_attention import paged_attention_decode, paged_attention_decode_ref
from tests.kv_pools import layer_cache

pytestmark = pytest.mark.gpu(1)

TOLERANCES = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
DTYPES = list(TOLERANCES)


@pytest.fixture(autouse=True)
def _cuda_kernels() -> None:
    assert not dispatch.kernels_interpreted(), "kernels must be compiled, not interpreted"
    torch.manual_seed(0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "kv_heads", "head_dim"), [(32, 8, 128), (12, 12, 64)])
def test_paged_attention_on_a_v2_pool(
    dtype: torch.dtype, num_heads: int, kv_heads: int, head_dim: int
) -> None:
    block_size, seq_lens = 16, [1, 17, 333, 1021]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5
    gen = torch.Generator().manual_seed(0)
    cache = layer_cache("v2", num_blocks, block_size, kv_heads, head_dim, dtype, "cuda", gen)
    ids = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    start = 0
    for i, count in enumerate(blocks_per_seq):
        tables[i, :count] = torch.tensor(ids[start : start + count])
        start += count
    tables, lens = tables.cuda(), torch.tensor(seq_lens, device="cuda")
    q = torch.randn(len(seq_lens), num_heads, head_dim, device="cuda").to(dtype)
    args = (q, cache.key_cache, cache.value_cache, tables, lens, head_dim**-0.5)
    got = paged_attention_decode(*args)
    torch.testing.assert_close(
        got.float(), paged_attention_decode_ref(*args).float(), **TOLERANCES[dtype]
    )
    assert torch.equal(dispatch.paged_attention_decode(*args), got)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mamba_state_update_at_nemotron_h_shapes(dtype: torch.dtype) -> None:
    batch, nheads, head_dim, dstate, ngroups, slots = 6, 64, 64, 128, 8, 16
    state = torch.randn(slots, nheads, head_dim, dstate, device="cuda")
    inputs = {
        "slot_indices": torch.tensor([9, 0, 15, 4, 2, 11], device="cuda"),
        "x": torch.randn(batch, nheads, head_dim, device="cuda").to(dtype),
        "dt": torch.randn(batch, nheads, device="cuda").to(dtype),
        "dt_bias": torch.randn(nheads, device="cuda"),
        "A": -torch.rand(nheads, device="cuda") * 4,
        "B": torch.randn(batch, ngroups, dstate, device="cuda").to(dtype),
        "C": torch.randn(batch, ngroups, dstate, device="cuda").to(dtype),
        "D": torch.randn(nheads, device="cuda"),
        "z": torch.randn(batch, nheads, head_dim, device="cuda").to(dtype),
    }
    by_kernel, by_ref = state.clone(), state.clone()
    y = mamba_state_update(by_kernel, **inputs, dt_limit=(0.001, 10.0))
    y_ref = mamba_state_update_ref(by_ref, **inputs, dt_limit=(0.001, 10.0))
    torch.testing.assert_close(by_kernel, by_ref, atol=1e-4, rtol=1e-4)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol["atol"] * 10, rtol=tol["rtol"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_gather_scatter_copy_between_v1_and_v2(dtype: torch.dtype) -> None:
    shape = (64, 2, 16, 8, 128)
    v1 = torch.randn(shape, device="cuda").to(dtype)
    v2 = torch.zeros(64, 4, *shape[1:], device="cuda", dtype=dtype)
    ids = [63, 2, 17, 40, 5]
    staging = block_copy.gather_blocks(v1, ids)
    assert torch.equal(staging, block_copy.gather_blocks_ref(v1, ids))
    block_copy.scatter_blocks(v2[:, 3], [1, 2, 3, 4, 6], staging)
    assert torch.equal(v2[[1, 2, 3, 4, 6], 3], v1[ids])
    back = torch.zeros_like(v1)
    block_copy.copy_blocks(v2[:, 3], [1, 2, 3, 4, 6], back, ids)
    assert torch.equal(back[ids], v1[ids])
