"""MoE layer bench: an E layer's time at decode and prefill sizes against its
memory and compute bounds, both measured on this machine in the same run.

    python -m benchmarks.moe_bench [--hidden 1024] [--experts 32]
        [--intermediate 512] [--top-k 6] [--shared 1024] [--dtype float32]
        [--decode 1 8] [--prefill 256] [--layers 4] [--rounds 5]

Three paths run the same layers on the same tokens, alternating within each
round (the machine is shared: a neighbour's burst hits one round of one
path, and every figure is the minimum over `--rounds`):

- loop: the loop over the chosen experts' own layers, one device read per
  expert (`routed_by_expert_loop`), and the shared expert's own layers: the
  path the layer ran before its expert weights were stacked;
- torch: the layer's forward with every product in torch (one BLAS product
  per chosen expert, the segment bounds read once);
- kernel: the layer's forward through the experts' C kernel at any size
  (the chosen experts and the shared expert in one call).

`runs` names the one of the last two that the layer picks at that size
(`dispatch.MOE_KERNEL_MAX_ROWS`).

Bounds of a step of T tokens (`step_bytes`, `step_flops`):

- memory: the weights the step must read (the fp32 router, each chosen
  expert once, the shared expert) over the read bandwidth of summing a
  tensor far larger than the caches;
- compute: 2 * T * hidden * (experts + top_k * 2 * intermediate + 2 * shared)
  FLOPs over the rate of a square matmul in the layer's dtype.

`--layers` layers with their own weights run in turn, so a layer's weights
come from memory rather than the caches (pick enough that the other layers'
chosen weights exceed the last-level cache); times are per layer.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from models.config import MoEConfig
from models.kernels import cpu_moe_experts, dispatch
from models.layers.moe import NemotronHMoE
from models.layers.moe_experts import routed_by_expert_loop

ROUTER_BYTES_PER_WEIGHT = 4  # the router stays float32 in every model dtype
_MATMUL_SIZE = 1024


@dataclass(frozen=True)
class MoEShape:
    hidden: int
    experts: int
    intermediate: int
    top_k: int
    shared: int
    weight_bytes: int  # bytes per expert weight: 4 for float32, 2 for bfloat16


@dataclass(frozen=True)
class Bounds:
    memory_s: float
    compute_s: float


def step_bytes(shape: MoEShape, distinct_experts: float) -> float:
    """The weight bytes a step reads: the router, each of the `distinct_experts`
    chosen experts once (up and down), and the shared expert."""
    router = shape.experts * shape.hidden * ROUTER_BYTES_PER_WEIGHT
    expert = 2 * shape.hidden * shape.intermediate * shape.weight_bytes
    shared = 2 * shape.hidden * shape.shared * shape.weight_bytes
    return router + distinct_experts * expert + shared


def step_flops(shape: MoEShape, tokens: int) -> int:
    """Multiply-adds times two of a step: router, top_k experts' up and down
    products, the shared expert's, per token."""
    per_token = shape.experts + shape.top_k * 2 * shape.intermediate + 2 * shape.shared
    return 2 * tokens * shape.hidden * per_token


def bounds(
    shape: MoEShape, tokens: int, distinct_experts: float, bandwidth: float, flop_rate: float
) -> Bounds:
    """The step's time bounds, given bytes/s and FLOP/s measured on this machine."""
    return Bounds(
        memory_s=step_bytes(shape, distinct_experts) / bandwidth,
        compute_s=step_flops(shape, tokens) / flop_rate,
    )


def _seconds(fn: Callable[[], object]) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


class MachineRates:
    """The machine's read bandwidth (summing a `stream_mib` MiB float32
    tensor) and matmul rate (a square matmul of `_MATMUL_SIZE` in `dtype`),
    each the best of every `sample()`. The bench samples once a round beside
    the paths, so bounds and paths see the same moments of a shared machine."""

    def __init__(self, stream_mib: int, dtype: torch.dtype) -> None:
        self.data = torch.ones(stream_mib << 18)
        self.a = torch.randn(_MATMUL_SIZE, _MATMUL_SIZE).to(dtype)
        self.b = torch.randn(_MATMUL_SIZE, _MATMUL_SIZE).to(dtype)
        self.sum_s = self.matmul_s = float("inf")

    def sample(self) -> None:
        self.sum_s = min(self.sum_s, _seconds(self.data.sum))
        self.matmul_s = min(self.matmul_s, _seconds(lambda: self.a @ self.b))

    @property
    def bytes_per_s(self) -> float:
        return self.data.nbytes / self.sum_s

    @property
    def flops_per_s(self) -> float:
        return 2 * _MATMUL_SIZE**3 / self.matmul_s


def build_layers(shape: MoEShape, count: int, dtype: torch.dtype) -> list[NemotronHMoE]:
    config = MoEConfig(
        num_experts=shape.experts,
        top_k=shape.top_k,
        intermediate_size=shape.intermediate,
        shared_intermediate_size=shape.shared,
    )
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(count):
        layer = NemotronHMoE(shape.hidden, config).to(dtype).eval()
        with torch.no_grad():  # spread the tokens over the experts
            layer.gate.weight.copy_(torch.randn(layer.gate.weight.shape, generator=gen) * 0.05)
        layers.append(layer)
    return layers


def loop_forward(layer: NemotronHMoE, x: torch.Tensor) -> torch.Tensor:
    experts, weights = layer.gate(x)
    out = routed_by_expert_loop(x, experts, weights, layer.experts).to(x.dtype)
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(x)
    return out


@contextmanager
def _kernel_rows(limit: int) -> Iterator[None]:
    """The layer's products on the C kernel up to `limit` rows an expert (0: never)."""
    kept = dispatch.MOE_KERNEL_MAX_ROWS
    dispatch.MOE_KERNEL_MAX_ROWS = limit
    try:
        yield
    finally:
        dispatch.MOE_KERNEL_MAX_ROWS = kept


def _forward_with(limit: int) -> Callable[[NemotronHMoE, torch.Tensor], torch.Tensor]:
    def forward(layer: NemotronHMoE, x: torch.Tensor) -> torch.Tensor:
        with _kernel_rows(limit):
            return layer(x)

    return forward


PATHS: dict[str, Callable[[NemotronHMoE, torch.Tensor], torch.Tensor]] = {
    "loop": loop_forward,
    "torch": _forward_with(0),
    "kernel": _forward_with(1 << 40),
}


def measure(
    layers: list[NemotronHMoE],
    tokens: int,
    rounds: int,
    dtype: torch.dtype,
    rates: MachineRates,
) -> tuple[dict[str, float], int]:
    """Min-of-rounds seconds per layer for each path, and the distinct experts
    the layers chose (summed over the layers); `rates` sampled each round."""
    x = torch.randn(tokens, layers[0].gate.weight.shape[1], generator=torch.Generator()).to(dtype)
    distinct = sum(int(torch.unique(layer.gate(x)[0]).numel()) for layer in layers)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for name, path in PATHS.items():
        torch.testing.assert_close(
            path(layers[0], x), loop_forward(layers[0], x), rtol=tol, atol=tol, msg=name
        )
    best = dict.fromkeys(PATHS, float("inf"))
    for _ in range(rounds):
        rates.sample()
        for name, path in PATHS.items():
            begin = time.perf_counter()
            for layer in layers:
                path(layer, x)
            best[name] = min(best[name], (time.perf_counter() - begin) / len(layers))
    return best, distinct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--shared", type=int, default=1024, help="0: no shared expert")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--decode", type=int, nargs="*", default=[1, 8], help="tokens per step")
    parser.add_argument("--prefill", type=int, nargs="*", default=[256], help="tokens per step")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--stream-mib", type=int, default=512, help="MiB summed for bandwidth")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    shape = MoEShape(
        args.hidden, args.experts, args.intermediate, args.top_k, args.shared, dtype.itemsize
    )
    torch.set_grad_enabled(False)
    layers = build_layers(shape, args.layers, dtype)
    rates = MachineRates(args.stream_mib, dtype)
    steps = [("decode", t) for t in args.decode] + [("prefill", t) for t in args.prefill]
    results = [
        (kind, tokens, *measure(layers, tokens, args.rounds, dtype, rates))
        for kind, tokens in steps
    ]
    kernel = "built" if cpu_moe_experts.available() else "unavailable (torch runs instead)"
    print(
        f"E layer: hidden {shape.hidden}, {shape.experts} experts of {shape.intermediate}, "
        f"top-{shape.top_k}, shared {shape.shared}, {args.dtype}, {args.layers} layers, "
        f"{torch.get_num_threads()} threads; C kernel {kernel}"
    )
    print(
        f"read bandwidth {rates.bytes_per_s / 1e9:.1f} GB/s (sum of {args.stream_mib} MiB), "
        f"matmul {rates.flops_per_s / 1e9:.1f} GFLOP/s ({_MATMUL_SIZE}^3 {args.dtype}); "
        "each the best of every round"
    )
    print("ms per layer, min of rounds; x mem / x flop: time over the memory / compute bound")
    print(
        f"{'step':>8} {'tokens':>6} {'runs':>6} {'MB read':>8} {'mem ms':>7} {'flop ms':>7}"
        + "".join(f" {name:>7} {'x mem':>6} {'x flop':>6}" for name in PATHS)
    )
    for kind, tokens, best, distinct in results:
        print(_row(shape, kind, tokens, best, distinct / len(layers), rates))


def _row(
    shape: MoEShape,
    kind: str,
    tokens: int,
    best: dict[str, float],
    distinct: float,
    rates: MachineRates,
) -> str:
    bound = bounds(shape, tokens, distinct, rates.bytes_per_s, rates.flops_per_s)
    rows_per_expert = tokens * shape.top_k / shape.experts
    runs = "kernel" if rows_per_expert <= dispatch.MOE_KERNEL_MAX_ROWS else "torch"
    cells = "".join(
        f" {1e3 * best[name]:>7.2f} {best[name] / bound.memory_s:>6.2f}"
        f" {best[name] / bound.compute_s:>6.2f}"
        for name in PATHS
    )
    return (
        f"{kind:>8} {tokens:>6} {runs:>6} {step_bytes(shape, distinct) / 1e6:>8.1f}"
        f" {1e3 * bound.memory_s:>7.2f} {1e3 * bound.compute_s:>7.2f}{cells}"
    )


if __name__ == "__main__":
    main()
