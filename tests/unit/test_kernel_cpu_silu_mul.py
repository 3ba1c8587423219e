"""The C SwiGLU activation kernel against its plain-torch twin."""

from __future__ import annotations

import pytest
import torch

from models.kernels import cpu_build, cpu_silu_mul, dispatch
from models.layers.linear_mlp import SwiGLUMLP

pytestmark = pytest.mark.skipif(
    cpu_build.load("silu_mul") is None, reason="no C compiler to build the CPU kernels"
)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2 * 64), (7, 2 * 100), (33, 2 * 1536), (5, 2 * 3)])
def test_matches_torch(
    monkeypatch: pytest.MonkeyPatch, threads: int, dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    monkeypatch.setattr(cpu_silu_mul, "_PARALLEL_ELEMENTS", 0 if threads > 1 else 1 << 60)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(shape[0])
    # Wide enough to reach both sigmoid branches and the exp's underflow.
    gate_up = (8 * torch.randn(*shape, generator=gen)).to(dtype)
    gate_up[0, 0], gate_up[0, 1] = -200.0, 200.0
    assert cpu_silu_mul.supported(gate_up)
    got = cpu_silu_mul.silu_mul_if_supported(gate_up)
    assert got is not None and got.shape == (shape[0], shape[1] // 2) and got.dtype == dtype
    want = dispatch.silu_mul_ref(gate_up)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    else:  # the same two roundings as torch: at most one bf16 step apart
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-5)


def test_strided_rows_are_read_in_place() -> None:
    wide = torch.randn(6, 80)
    gate_up = wide[::2, 8:72]  # row stride 160, 64 contiguous values per row
    assert cpu_silu_mul.supported(gate_up)
    got = cpu_silu_mul.silu_mul_if_supported(gate_up)
    torch.testing.assert_close(got, dispatch.silu_mul_ref(gate_up))


def test_other_tensors_fall_back_to_torch() -> None:
    three_d = torch.randn(2, 3, 16)
    odd = torch.randn(4, 15)
    columns = torch.randn(16, 4).t()  # rows not contiguous
    grad = torch.randn(4, 16, requires_grad=True)
    half = torch.randn(4, 16).half()
    for t in (three_d, odd, columns, grad, half):
        assert not cpu_silu_mul.supported(t)
    torch.testing.assert_close(dispatch.silu_mul(three_d), dispatch.silu_mul_ref(three_d))
    torch.testing.assert_close(dispatch.silu_mul(half), dispatch.silu_mul_ref(half))
    dispatch.silu_mul(grad).sum().backward()  # the torch path keeps the graph
    assert grad.grad is not None


def test_the_fused_mlp_equals_the_unfused_one() -> None:
    torch.manual_seed(0)
    mlp = SwiGLUMLP(32, 48)
    x = torch.randn(9, 32)
    with torch.no_grad():
        want = mlp(x)  # before fusion: the layers one by one
        mlp.fuse_projections()
        torch.testing.assert_close(mlp(x), want)
