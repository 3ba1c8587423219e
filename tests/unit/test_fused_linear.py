"""FusedLinear: one matmul equal to the separate layers, sharing their storage."""

from __future__ import annotations

import pytest
import torch

from models.kernels import cpu_skinny_gemm
from models.layers.fused_linear import (
    BLOCKED,
    DEFAULT_FEW_ROW_PATHS,
    FEW_ROWS_MAX,
    ROW_MAJOR,
    ROW_MAJOR_MAX_ROWS,
    SKINNY,
    FusedLinear,
)
from models.layers.linear_mlp import SwiGLUMLP


def _layers(bias: bool) -> list[torch.nn.Linear]:
    torch.manual_seed(0)
    return [torch.nn.Linear(16, rows, bias=bias) for rows in (12, 4, 4)]


@pytest.mark.parametrize("bias", [False, True])
def test_fused_output_is_the_layers_outputs_side_by_side(bias: bool) -> None:
    layers = _layers(bias)
    x = torch.randn(5, 16)
    want = torch.cat([layer(x) for layer in layers], dim=-1)
    fused = FusedLinear(layers)
    assert fused.is_current()
    torch.testing.assert_close(fused(x), want)
    # The layers themselves still compute the same thing from the shared storage.
    torch.testing.assert_close(torch.cat([layer(x) for layer in layers], dim=-1), want)


def test_writes_through_a_layer_reach_the_fused_weight() -> None:
    layers = _layers(bias=False)
    fused = FusedLinear(layers)
    with torch.no_grad():
        layers[1].weight.copy_(torch.ones(4, 16))
    assert torch.equal(fused.weight[12:16], torch.ones(4, 16))
    assert dict(layers[1].named_parameters())["weight"].shape == (4, 16)


def test_a_dtype_change_makes_the_fusion_stale_and_the_mlp_still_correct() -> None:
    torch.manual_seed(0)
    mlp = SwiGLUMLP(16, 32)
    x = torch.randn(3, 16)
    want = mlp(x)
    mlp.fuse_projections()
    torch.testing.assert_close(mlp(x), want)
    mlp.to(torch.float64)
    assert mlp.gate_up is not None and not mlp.gate_up.is_current()
    torch.testing.assert_close(mlp(x.double()), want.double())


@pytest.mark.parametrize("replaced", [0, 2])
def test_a_replaced_weight_makes_the_fusion_stale(replaced: int) -> None:
    layers = _layers(bias=False)
    fused = FusedLinear(layers)
    layers[replaced].weight = torch.nn.Parameter(layers[replaced].weight.detach().clone())
    assert not fused.is_current()
    alone = FusedLinear([torch.nn.Linear(16, 8)])
    alone.linears[0].weight = torch.nn.Parameter(torch.zeros(8, 16))
    assert not alone.is_current()


def test_layers_that_do_not_share_an_input_are_refused() -> None:
    with pytest.raises(ValueError, match="in_features"):
        FusedLinear([torch.nn.Linear(16, 4), torch.nn.Linear(8, 4)])


_BF16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(
        not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no oneDNN bf16 on this CPU"
    ),
)


@pytest.mark.parametrize("dtype", [torch.float32, _BF16])
def test_cpu_layers_are_prepacked_and_a_later_write_falls_back(dtype: torch.dtype) -> None:
    layers = [layer.to(dtype) for layer in _layers(bias=True)]
    x = torch.randn(7, 16, dtype=dtype)
    want = torch.cat([layer(x) for layer in layers], dim=-1)
    fused = FusedLinear(layers)
    assert fused.packed is not None
    torch.testing.assert_close(fused(x), want)
    with torch.no_grad():
        layers[0].weight.zero_()
    # The blocked copy is a snapshot: after a write the fusion is stale.
    assert not fused.is_current()


def _packed_products(
    fused: FusedLinear, rows: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> int:
    """How many blocked products `fused` runs to multiply `rows` rows (the
    result checked against the layer's own)."""
    calls: list[int] = []
    matmul = FusedLinear.packed_matmul

    def recording(self: FusedLinear, x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return matmul(self, x)

    monkeypatch.setattr(FusedLinear, "packed_matmul", recording)
    layer = fused.linears[0]
    x = torch.randn(rows, layer.in_features, dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused(x), layer(x), rtol=tolerance, atol=tolerance)
    return len(calls)


def test_fp32_products_of_a_few_rows_use_the_row_major_weight_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    fused = FusedLinear([torch.nn.Linear(64, 256, bias=True)])
    assert fused.packed is not None
    assert fused.few_row_paths == DEFAULT_FEW_ROW_PATHS == (ROW_MAJOR,) * ROW_MAJOR_MAX_ROWS
    for rows in range(1, ROW_MAJOR_MAX_ROWS + 1):
        assert _packed_products(fused, rows, torch.float32, monkeypatch) == 0
    assert _packed_products(fused, ROW_MAJOR_MAX_ROWS + 1, torch.float32, monkeypatch) == 1


@pytest.mark.parametrize("shape", [(2, 2, 64), (4, 64), (1, 1, 64), (5, 64)])
def test_the_few_row_kernel_path_gives_the_layers_product(
    shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    fused = FusedLinear([torch.nn.Linear(64, 200, bias=True), torch.nn.Linear(64, 56, bias=True)])
    fused.few_row_paths = (SKINNY,) * FEW_ROWS_MAX
    x = torch.randn(*shape)
    rows = x.numel() // 64
    calls: list[int] = []
    packed_matmul = FusedLinear.packed_matmul
    monkeypatch.setattr(
        FusedLinear, "packed_matmul", lambda self, x: calls.append(1) or packed_matmul(self, x)
    )
    out = fused(x)
    assert out.shape == (*shape[:-1], 256)
    expected = torch.cat([lin(x) for lin in fused.linears], dim=-1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert fused.path_for(x) == (SKINNY if rows <= FEW_ROWS_MAX else BLOCKED)
    # Without the kernel library the blocked copy serves.
    kernel_ran = cpu_skinny_gemm.available() and rows <= FEW_ROWS_MAX
    assert len(calls) == (0 if kernel_ran else 1)


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no oneDNN bf16 on this CPU"
)
def test_bf16_products_use_the_blocked_copy_at_every_row_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    fused = FusedLinear([torch.nn.Linear(64, 256, bias=False).to(torch.bfloat16)])
    assert fused.packed is not None
    assert _packed_products(fused, 1, torch.bfloat16, monkeypatch) == 1
