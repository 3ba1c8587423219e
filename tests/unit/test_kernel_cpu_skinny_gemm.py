"""The C few-row product kernel against `F.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.kernels import cpu_build, cpu_skinny_gemm

pytestmark = pytest.mark.skipif(
    cpu_build.load("skinny_gemm") is None, reason="no C compiler to build the CPU kernels"
)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", range(1, cpu_skinny_gemm.MAX_ROWS + 1))
@pytest.mark.parametrize(
    ("n", "k"),
    # whole vectors and tiles; a k tail; n past whole tiles of 8; fewer than one vector
    [(64, 576), (200, 100), (13, 37), (3, 7)],
)
def test_matches_f_linear(
    monkeypatch: pytest.MonkeyPatch, threads: int, bias: bool, rows: int, n: int, k: int
) -> None:
    monkeypatch.setattr(cpu_skinny_gemm, "_PARALLEL_WEIGHTS", 0 if threads > 1 else 1 << 60)
    monkeypatch.setattr(cpu_skinny_gemm, "_MIN_CHUNK", 8)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=gen)
    weight = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    assert cpu_skinny_gemm.supported(x, weight, b)
    got = cpu_skinny_gemm.skinny_gemm_if_supported(x, weight, b)
    assert got is not None and got.shape == (rows, n) and got.dtype == torch.float32
    # Against float64: each output within a few fp32 roundings of its terms' magnitude.
    want = F.linear(x.double(), weight.double(), None if b is None else b.double())
    scale = F.linear(x.abs().double(), weight.abs().double()) + (0 if b is None else b.abs())
    assert ((got.double() - want).abs() <= 1e-6 * scale).all()
    assert ((F.linear(x, weight, b).double() - want).abs() <= 1e-6 * scale).all()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("n", "k"), [(77, 300), (64, 576), (13, 37), (17, 129), (9, 5)])
def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it(bias: bool, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k)
    x = torch.randn(cpu_skinny_gemm.MAX_ROWS, k, generator=gen)
    weight = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    alone = [
        cpu_skinny_gemm.skinny_gemm_if_supported(x[i : i + 1], weight, b) for i in range(len(x))
    ]
    for rows in range(2, cpu_skinny_gemm.MAX_ROWS + 1):
        together = cpu_skinny_gemm.skinny_gemm_if_supported(x[:rows], weight, b)
        assert together is not None
        for i in range(rows):
            row = alone[i]
            assert row is not None and torch.equal(row[0], together[i]), (rows, i)


def test_strided_rows_are_read_in_place() -> None:
    wide = torch.randn(6, 80)
    x = wide[::2, 8:72]  # row stride 160, 64 contiguous values per row
    rows = torch.randn(40, 100)
    weight = rows[:, 10:74]  # row stride 100
    assert cpu_skinny_gemm.supported(x, weight, None)
    got = cpu_skinny_gemm.skinny_gemm_if_supported(x, weight)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_other_tensors_are_left_to_other_paths() -> None:
    weight = torch.randn(8, 16)
    too_many = torch.randn(cpu_skinny_gemm.MAX_ROWS + 1, 16)
    columns = torch.randn(16, 2).t()  # rows not contiguous
    grad = torch.randn(2, 16, requires_grad=True)
    for x, w, bias in [
        (too_many, weight, None),
        (torch.randn(0, 16), weight, None),
        (torch.randn(2, 16, dtype=torch.bfloat16), weight.bfloat16(), None),
        (torch.randn(2, 1, 16), weight, None),
        (columns, weight, None),
        (torch.randn(2, 16), weight.t().contiguous().t(), None),  # weight columns strided
        (torch.randn(2, 15), weight, None),  # widths disagree
        (torch.randn(2, 16), weight, torch.randn(7)),  # bias of another width
        (grad, weight, None),
    ]:
        assert not cpu_skinny_gemm.supported(x, w, bias)
        assert cpu_skinny_gemm.skinny_gemm_if_supported(x, w, bias) is None
    with torch.no_grad():
        assert cpu_skinny_gemm.supported(grad, weight, None)


def test_the_kernel_refuses_more_rows_than_it_takes() -> None:
    kernel = cpu_skinny_gemm._KERNEL.get()
    rows = cpu_skinny_gemm.MAX_ROWS + 1
    x, weight, y = torch.randn(rows, 16), torch.randn(8, 16), torch.empty(rows, 8)
    status = kernel(
        x.data_ptr(), 16, weight.data_ptr(), 16, None, y.data_ptr(), 8, rows, 8, 16, 8, 1
    )
    assert status == 1


def test_turned_off_the_kernel_serves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_build.ENABLE_ENV, "0")
    cpu_build.enabled.cache_clear()
    try:
        assert not cpu_skinny_gemm.available()
        assert (
            cpu_skinny_gemm.skinny_gemm_if_supported(torch.randn(1, 16), torch.randn(8, 16)) is None
        )
    finally:
        monkeypatch.delenv(cpu_build.ENABLE_ENV)
        cpu_build.enabled.cache_clear()
