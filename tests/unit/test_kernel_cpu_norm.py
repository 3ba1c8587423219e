"""The C RMSNorm kernel (plain and fused with the residual add) against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.kernels import cpu_build, cpu_norm, dispatch
from models.layers.norm import RMSNorm

pytestmark = pytest.mark.skipif(
    cpu_build.load("rms_norm") is None, reason="no C compiler to build the CPU kernels"
)


def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference models' RMSNorm: fp32 statistic, one rounding, then the weight."""
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 100), (33, 512)])
def test_matches_the_reference_rounding(
    monkeypatch: pytest.MonkeyPatch, threads: int, dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    monkeypatch.setattr(cpu_norm, "_PARALLEL_ELEMENTS", 0 if threads > 1 else 1 << 60)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(shape[0])
    x = (3 * torch.randn(*shape, generator=gen)).to(dtype)
    weight = torch.randn(shape[1], generator=gen).to(dtype)
    residual = torch.randn(*shape, generator=gen).to(dtype)
    assert cpu_norm.supported(x, weight, residual)

    got = cpu_norm.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, _reference(x, weight, 1e-5), atol=1e-6, rtol=1e-5)

    stream = residual.clone()
    fused = cpu_norm.rms_norm(x, weight, 1e-5, stream)
    assert torch.equal(stream, residual + x)  # the add rounds exactly as torch's
    torch.testing.assert_close(fused, _reference(residual + x, weight, 1e-5), atol=1e-6, rtol=1e-5)


def test_strided_rows_are_read_in_place() -> None:
    wide = torch.randn(6, 80)
    x = wide[::2, 8:72]  # row stride 160, 64 contiguous values per row
    weight = torch.randn(64)
    assert cpu_norm.supported(x, weight, None)
    torch.testing.assert_close(cpu_norm.rms_norm(x, weight, 1e-6), _reference(x, weight, 1e-6))


def test_layer_and_dispatch_fall_back_to_torch_where_the_kernel_does_not_apply() -> None:
    norm = RMSNorm(16, eps=1e-5)
    x = torch.randn(3, 4, 16)  # 3-D: torch path
    assert not cpu_norm.supported(x, norm.weight, None)
    with torch.no_grad():
        torch.testing.assert_close(norm(x), _reference(x, norm.weight, 1e-5))
    # With autograd on, the layer keeps the graph (torch path).
    x2 = torch.randn(4, 16, requires_grad=True)
    assert not cpu_norm.supported(x2, norm.weight, None)
    norm(x2).sum().backward()
    assert x2.grad is not None
    # fp16 runs in torch; the fused form still updates the stream in place.
    half = torch.randn(4, 16).half()
    stream = torch.randn(4, 16).half()
    expected_stream = stream + half
    out = dispatch.rms_norm(half, norm.weight.detach().half(), 1e-5, stream)
    assert torch.equal(stream, expected_stream)
    want = norm.weight.detach().half() * F.rms_norm(expected_stream, (16,), eps=1e-5)
    torch.testing.assert_close(out, want)


def test_add_and_norm_matches_the_unfused_pre_norm_block() -> None:
    norm = RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32))
        x, residual = torch.randn(5, 32), torch.randn(5, 32)
        normed, stream = norm.add_and_norm(x, residual.clone())
        torch.testing.assert_close(stream, residual + x)
        torch.testing.assert_close(normed, _reference(residual + x, norm.weight, 1e-6))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width", "group"), [(1, 64, 64), (5, 96, 24), (40, 1024, 256)])
def test_the_gated_norm_matches_transformers_on_strided_gates(
    monkeypatch: pytest.MonkeyPatch,
    threads: int,
    dtype: torch.dtype,
    rows: int,
    width: int,
    group: int,
) -> None:
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNormGated

    monkeypatch.setattr(cpu_norm, "_PARALLEL_ELEMENTS", 0 if threads > 1 else 1 << 60)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(rows)
    x = 2 * torch.randn(rows, width, generator=gen)  # the scan's float32 y
    projected = (3 * torch.randn(rows, width + 40, generator=gen)).to(dtype)
    z = projected[:, 17 : 17 + width]  # in_proj's gate columns: strided rows
    weight = torch.randn(width, generator=gen).to(dtype)
    reference = NemotronHRMSNormGated(width, group, eps=1e-5)
    reference.weight.data = weight
    with torch.no_grad():
        want = reference(x, z).to(dtype)

    got = cpu_norm.gated_rms_norm_if_supported(x, z, weight, group, 1e-5)
    assert got is not None and got.dtype == dtype
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(got, want, **tolerance)
    torch.testing.assert_close(cpu_norm.gated_rms_norm_ref(x, z, weight, group, 1e-5), want)
    torch.testing.assert_close(dispatch.gated_rms_norm(x, z, weight, group, 1e-5), got)


def test_the_gated_norm_refuses_what_it_cannot_serve() -> None:
    x, z, weight = torch.randn(3, 64), torch.randn(3, 64), torch.randn(64)
    assert cpu_norm.gated_rms_norm_if_supported(x, z, weight, 24, 1e-5) is None  # 64 % 24
    assert cpu_norm.gated_rms_norm_if_supported(x.bfloat16(), z, weight, 32, 1e-5) is None
    assert cpu_norm.gated_rms_norm_if_supported(x, z.t().contiguous().t(), weight, 32, 1e-5) is None
    assert cpu_norm.gated_rms_norm_if_supported(x, z, weight, 32, 1e-5) is not None
