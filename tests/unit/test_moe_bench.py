"""The MoE bench's bounds arithmetic, and one tiny measured step."""

from __future__ import annotations

import pytest
import torch

from benchmarks import moe_bench
from benchmarks.moe_bench import MachineRates, MoEShape, bounds, step_bytes, step_flops

# hidden 8, 4 experts of 3, top-2, shared 5, bf16 weights
SHAPE = MoEShape(hidden=8, experts=4, intermediate=3, top_k=2, shared=5, weight_bytes=2)


def test_a_step_reads_the_router_each_chosen_expert_once_and_the_shared_expert() -> None:
    router = 4 * 8 * 4  # float32 whatever the weights' dtype
    expert = 2 * 8 * 3 * 2  # up [3, 8] and down [8, 3]
    shared = 2 * 8 * 5 * 2
    assert step_bytes(SHAPE, 3) == router + 3 * expert + shared == 576
    assert step_bytes(SHAPE, 0) == router + shared


def test_a_steps_flops_count_every_tokens_products() -> None:
    # per token: router 8 x 4, two experts' up and down 2 x 2 x 8 x 3, shared 2 x 8 x 5
    per_token = 2 * (8 * 4 + 2 * 2 * 8 * 3 + 2 * 8 * 5)
    assert step_flops(SHAPE, 1) == per_token == 416
    assert step_flops(SHAPE, 7) == 7 * per_token


def test_bounds_divide_by_the_measured_rates() -> None:
    got = bounds(SHAPE, tokens=2, distinct_experts=3, bandwidth=576.0, flop_rate=208.0)
    assert got.memory_s == pytest.approx(1.0)
    assert got.compute_s == pytest.approx(4.0)


def test_machine_rates_keep_the_best_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    rates = MachineRates(stream_mib=1, dtype=torch.float32)
    times = iter([0.5, 2.0, 0.25, 4.0, 1.0, 1.0])  # sum, matmul, per sample
    monkeypatch.setattr(moe_bench, "_seconds", lambda fn: next(times))
    for _ in range(3):
        rates.sample()
    assert rates.bytes_per_s == (1 << 20) / 0.25
    assert rates.flops_per_s == 2 * moe_bench._MATMUL_SIZE**3 / 1.0


def test_a_tiny_step_runs_every_path_to_the_same_result() -> None:
    torch.set_grad_enabled(False)
    try:
        shape = MoEShape(16, 4, 8, 2, 8, 4)
        layers = moe_bench.build_layers(shape, 2, torch.float32)
        best, distinct = moe_bench.measure(
            layers, 3, 1, torch.float32, MachineRates(1, torch.float32)
        )
    finally:
        torch.set_grad_enabled(True)
    assert set(best) == set(moe_bench.PATHS) and all(t > 0 for t in best.values())
    assert 2 <= distinct <= 2 * 4
