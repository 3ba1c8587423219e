"""Which path an fp32 product of a few rows takes on this CPU, measured once
when the model is loaded.

`FusedLinear` multiplies a decode step's few rows on oneDNN's blocked copy
of the weight, on the row-major weight through `F.linear` (torch's BLAS,
MKL in the CPU wheels), or on the row-major weight through the few-row C
kernel (`models.kernels.cpu_skinny_gemm`). Which is fastest depends on the
CPU, not on the model: on an Intel Xeon the row-major product won at 1 to 3
rows, while on an AMD EPYC (Zen 4) MKL's few-row product runs on one thread
and lost at every row count, and the kernel won at 1 to 3 rows
(docs/performance.md, "Few-row products"). So `choose_few_row_paths(model)` times the paths
on the model's own products at the row counts of `TIMED_ROWS` (1, 2, 3,
4, then every few up to `FEW_ROWS_MAX`) and keeps, per row count, the
fastest where it beats the blocked path by a clear margin (`_MARGIN`; in
doubt the blocked path, which larger steps take anyway); a row count between
two timed ones takes the path of the next one up. The first row count where
the blocked path holds ends the search. On an AMD EPYC Zen 2 (one thread)
the kernel won up to 24 rows, where it reads the next weight rows ahead
while it multiplies (see `csrc/skinny_gemm.c`).

Timing covers the products in step order up to `_TIMED_BYTES` of weights
(more than any cache a thread sees, so they stream from memory as in a
step), alternating the paths, best of `_REPEATS` passes each. A model whose
products hold under `_MIN_BYTES` keeps the default (`FusedLinear`'s own):
its products take microseconds either way, and timing them would measure
noise and could pick differently in two processes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from models.kernels import cpu_skinny_gemm
from models.layers.fused_linear import (
    BLOCKED,
    FEW_ROWS_MAX,
    ROW_MAJOR,
    ROW_MAJOR_MAX_ROWS,
    SKINNY,
    FusedLinear,
)

logger = logging.getLogger(__name__)

_MIN_BYTES = 8 << 20
_TIMED_BYTES = 256 << 20
_REPEATS = 3
# Another path is kept only where its best pass is this much faster than the blocked one.
_MARGIN = 0.95

PATHS = (BLOCKED, ROW_MAJOR, SKINNY)
# The row counts timed: each one up to the row-major path's last, then
# sparser, since a product's time grows smoothly with its rows (every
# count up to 32 would take half a minute on SmolLM2-135M).
TIMED_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
PassTimer = Callable[[int, str], float]  # (rows, path) -> seconds of one pass


def fusions(model: torch.nn.Module) -> list[FusedLinear]:
    """The model's prepacked products in the order a step runs them (layer
    by layer, the logits head last), each once."""
    found: dict[int, FusedLinear] = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, FusedLinear) and value.packed is not None:
                found.setdefault(id(value), value)
    ordered = list(found.values())
    head = [f for f in ordered if f is getattr(model, "logits_head", None)]
    return [f for f in ordered if f not in head] + head


def paths_at(rows: int, skinny: bool | None = None) -> tuple[str, ...]:
    """The paths a product of `rows` rows can take: the blocked copy always,
    the row-major weight up to `ROW_MAJOR_MAX_ROWS` rows, the few-row kernel
    up to `FEW_ROWS_MAX` where it is built (`skinny`: whether it is; by
    default, asked of the kernel library)."""
    if skinny is None:
        skinny = cpu_skinny_gemm.available()
    paths = [BLOCKED]
    if rows <= ROW_MAJOR_MAX_ROWS:
        paths.append(ROW_MAJOR)
    if skinny and rows <= FEW_ROWS_MAX:
        paths.append(SKINNY)
    return tuple(paths)


def run_pass(products: Sequence[FusedLinear], inputs: dict[int, torch.Tensor], path: str) -> float:
    """Seconds for one product per entry of `products` on `path`, the
    input of each taken from `inputs` by its width."""
    start = time.perf_counter()
    for fused in products:
        fused.run_path(inputs[fused.weight.shape[1]], path)
    return time.perf_counter() - start


def few_row_paths(
    time_pass: PassTimer, skinny: bool, max_rows: int = FEW_ROWS_MAX
) -> tuple[tuple[str, ...], dict[int, dict[str, float]]]:
    """The path per row count (1, 2, ...) and the best pass of each path at
    every row count tried: the `TIMED_ROWS` up to `max_rows` in turn, the
    fastest path kept where it beats the blocked one by `_MARGIN`, also for
    the row counts since the last one timed; the first row count where none
    does ends the search."""
    chosen: list[str] = []
    best: dict[int, dict[str, float]] = {}
    for rows in (r for r in TIMED_ROWS if r <= max_rows):
        best[rows] = _best_passes(time_pass, rows, paths_at(rows, skinny))
        others = {path: s for path, s in best[rows].items() if path != BLOCKED}
        fastest = min(others, key=others.__getitem__, default=None)
        if fastest is None or others[fastest] >= _MARGIN * best[rows][BLOCKED]:
            break
        chosen.extend([fastest] * (rows - len(chosen)))
    return tuple(chosen), best


def _best_passes(time_pass: PassTimer, rows: int, paths: Sequence[str]) -> dict[str, float]:
    """Each path's best of `_REPEATS` passes, alternating, after a warm-up
    pass of each (first touches, oneDNN's primitive)."""
    for path in paths:
        time_pass(rows, path)
    seconds: dict[str, list[float]] = {path: [] for path in paths}
    for _ in range(_REPEATS):
        for path in paths:
            seconds[path].append(time_pass(rows, path))
    return {path: min(s) for path, s in seconds.items()}


def choose_few_row_paths(model: torch.nn.Module) -> tuple[str, ...] | None:
    """Measure the paths on `model`'s fp32 products and set every product's
    `few_row_paths`; returns them, or None where nothing was measured (no
    packed fp32 products, or under `_MIN_BYTES` of them)."""
    products = [f for f in fusions(model) if f.weight.dtype == torch.float32]
    if not products or sum(f.weight.nbytes for f in products) < _MIN_BYTES:
        return None
    timed, total = [], 0
    for fused in products:
        if total >= _TIMED_BYTES:
            break
        timed.append(fused)
        total += fused.weight.nbytes
    widths = {f.weight.shape[1] for f in timed}
    inputs: dict[int, dict[int, torch.Tensor]] = {}
    generator = torch.Generator().manual_seed(0)  # the global RNG is the caller's

    def time_pass(rows: int, path: str) -> float:
        if rows not in inputs:
            inputs[rows] = {w: torch.randn(rows, w, generator=generator) for w in widths}
        return run_pass(timed, inputs[rows], path)

    with torch.inference_mode():
        chosen, best = few_row_paths(time_pass, cpu_skinny_gemm.available())
    for fused in products:
        fused.few_row_paths = chosen
    logger.info(
        "fp32 products of a few rows, best pass over %d products (%.0f MiB): %s; paths by rows: %s",
        len(timed),
        total / 2**20,
        "; ".join(
            f"{rows} rows " + ", ".join(f"{path} {1e3 * s:.2f} ms" for path, s in passes.items())
            for rows, passes in best.items()
        ),
        ", ".join(chosen) or "blocked",
    )
    return chosen
