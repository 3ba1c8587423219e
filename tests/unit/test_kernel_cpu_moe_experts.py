"""The C kernel of a MoE layer's experts against float64 and its torch twin."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from models.kernels import cpu_build, cpu_moe_experts, dispatch
from models.kernels.cpu_moe_experts import SharedExpert

pytestmark = pytest.mark.skipif(
    cpu_build.load("moe_experts") is None, reason="no C compiler to build the CPU kernels"
)


class Layer:
    """Random routed experts (and shared expert) with a routing of `tokens`."""

    def __init__(
        self,
        tokens: int,
        hidden: int,
        inter: int,
        num_experts: int,
        top_k: int,
        shared_inter: int,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(tokens, hidden, generator=gen)
        self.up = torch.randn(num_experts, inter, hidden, generator=gen) * hidden**-0.5
        self.down = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
        self.shared: SharedExpert | None = None
        if shared_inter:
            self.shared = (
                torch.randn(shared_inter, hidden, generator=gen) * hidden**-0.5,
                torch.randn(hidden, shared_inter, generator=gen) * shared_inter**-0.5,
            )
        scores = torch.rand(tokens, num_experts, generator=gen)
        self.experts = scores.topk(top_k, dim=1, sorted=False).indices
        self.weights = torch.rand(tokens, top_k, generator=gen)

    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.x, self.experts, self.weights, self.up, self.down

    def kernel(self) -> torch.Tensor:
        out = cpu_moe_experts.moe_experts_if_supported(*self.args(), self.shared)
        assert out is not None
        return out

    def float64(self, absolute: bool = False) -> torch.Tensor:
        """The layer in float64, one token and expert at a time; with
        `absolute`, every product over absolute values (a bound on rounding)."""
        f: Callable[[torch.Tensor], torch.Tensor] = (
            (lambda t: t.double().abs()) if absolute else (lambda t: t.double())
        )
        out = torch.zeros(self.x.shape, dtype=torch.float64)
        for t, row in enumerate(f(self.x)):
            for e, w in zip(self.experts[t].tolist(), f(self.weights[t]), strict=True):
                out[t] += w * (f(self.down[e]) @ (f(self.up[e]) @ row).clamp(min=0).square())
            if self.shared is not None:
                hidden = (f(self.shared[0]) @ row).clamp(min=0).square()
                out[t] += f(self.shared[1]) @ hidden
        return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shared_inter", [0, 20])
@pytest.mark.parametrize(
    ("tokens", "top_k", "num_experts"),
    # one pair; experts left unchosen; more rows an expert than one group (4)
    [(1, 1, 1), (1, 3, 8), (5, 2, 4), (9, 3, 3), (13, 4, 6)],
)
@pytest.mark.parametrize(
    ("hidden", "inter"),
    # whole vectors and blocks; k tails and n past whole tiles; under one vector
    [(64, 48), (37, 29), (5, 3)],
)
def test_matches_float64_and_the_twin(
    monkeypatch: pytest.MonkeyPatch,
    threads: int,
    shared_inter: int,
    tokens: int,
    top_k: int,
    num_experts: int,
    hidden: int,
    inter: int,
) -> None:
    monkeypatch.setattr(cpu_moe_experts, "_PARALLEL_WEIGHTS", 0 if threads > 1 else 1 << 60)
    monkeypatch.setattr(cpu_moe_experts, "_CHUNK", 24)  # several work items an expert
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    layer = Layer(tokens, hidden, inter, num_experts, top_k, shared_inter, seed=hidden + tokens)
    got = layer.kernel()
    assert got.shape == layer.x.shape and got.dtype == torch.float32
    # Each output within a few fp32 roundings of its terms' magnitude.
    error = (got.double() - layer.float64()).abs()
    assert (error <= 1e-5 * layer.float64(absolute=True) + 1e-12).all()
    twin = cpu_moe_experts.moe_experts_ref(*layer.args(), layer.shared)
    torch.testing.assert_close(got, twin, rtol=1e-5, atol=1e-5)


def test_experts_no_token_chose_are_never_read() -> None:
    """An unchosen expert's weights are NaN: no output may see them."""
    layer = Layer(3, 16, 8, 6, 2, 0)
    unchosen = sorted(set(range(6)) - set(layer.experts.flatten().tolist()))
    assert unchosen
    layer.up[unchosen] = float("nan")
    layer.down[unchosen] = float("nan")
    assert torch.isfinite(layer.kernel()).all()
    chosen = int(layer.experts[0, 0])
    layer.down[chosen, 0, 0] = float("nan")  # a chosen expert does reach its token
    out = layer.kernel()
    assert out[0, 0].isnan() and torch.isfinite(out[:, 1:]).all()


def test_a_tokens_output_does_not_depend_on_the_tokens_beside_it() -> None:
    layer = Layer(11, 37, 21, 4, 2, 13, seed=1)
    together = layer.kernel()
    for t in range(11):
        alone = cpu_moe_experts.moe_experts_if_supported(
            layer.x[t : t + 1],
            layer.experts[t : t + 1],
            layer.weights[t : t + 1],
            layer.up,
            layer.down,
            layer.shared,
        )
        assert alone is not None and torch.equal(alone[0], together[t]), t


def test_an_expert_id_out_of_range_is_refused() -> None:
    layer = Layer(2, 8, 4, 3, 1, 0)
    layer.experts[1, 0] = 3
    with pytest.raises(cpu_moe_experts.MoEKernelError, match="out of range"):
        layer.kernel()


def test_other_tensors_are_left_to_the_twin() -> None:
    layer = Layer(3, 8, 4, 2, 1, 4)
    x, experts, weights, up, down = layer.args()
    for args in [
        (x.bfloat16(), experts, weights, up.bfloat16(), down.bfloat16(), None),
        (x, experts.int(), weights, up, down, None),
        (torch.randn(8, 3).t(), experts, weights, up, down, None),  # rows not contiguous
        (x, experts, weights, up.transpose(1, 2).contiguous(), down, None),
        (x, experts, weights[:, :0], up, down, None),
        (x, experts, weights, up, down, (torch.randn(4, 8), torch.randn(4, 8))),
        (x.requires_grad_(), experts, weights, up, down, None),
    ]:
        assert not cpu_moe_experts.supported(*args)
        assert cpu_moe_experts.moe_experts_if_supported(*args) is None


def test_dispatch_leaves_large_segments_to_the_twin(
    kernel_switch: Callable[[str, str | None], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past `MOE_KERNEL_MAX_ROWS` rows an expert on average, one BLAS product
    per expert is faster; with the C kernels off nothing runs the kernel."""
    calls: list[int] = []
    kernel = cpu_moe_experts.moe_experts_if_supported

    def counted(*args: object) -> torch.Tensor | None:
        calls.append(1)
        return kernel(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_moe_experts, "moe_experts_if_supported", counted)
    monkeypatch.setattr(dispatch, "MOE_KERNEL_MAX_ROWS", 2)
    at_limit, past = Layer(4, 8, 4, 2, 1, 0), Layer(5, 8, 4, 2, 1, 0)
    dispatch.moe_experts(*at_limit.args())
    assert len(calls) == 1
    torch.testing.assert_close(
        dispatch.moe_experts(*past.args()), cpu_moe_experts.moe_experts_ref(*past.args())
    )
    assert len(calls) == 1
    kernel_switch(cpu_build.ENABLE_ENV, "0")
    dispatch.moe_experts(*at_limit.args())
    assert len(calls) == 2 and cpu_moe_experts.moe_experts_if_supported(*at_limit.args()) is None
