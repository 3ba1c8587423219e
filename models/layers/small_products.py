"""Which path an fp32 product of a few rows takes on this CPU, measured once
when the model is loaded.

`FusedLinear` multiplies a decode step's few rows either on oneDNN's blocked
copy of the weight or on the row-major weight through `F.linear` (torch's
BLAS, MKL in the CPU wheels). Which is faster depends on the CPU, not on the
model: on an Intel Xeon the row-major product won at 1 to 3 rows (SmolLM2-135M,
one pass over its 121 products, 2 threads: 20.6 against 26.0 ms at 1 row,
24.0 against 27.5 at 3), while on an AMD EPYC (Zen 4) MKL's few-row product
runs on one thread and lost at every row count (45.8 against 24.1 ms at 1
row, 109 against 27.8 at 3; a SmolLM2 decode step at batch 1 took 55 ms
against 34 on the blocked path). So `choose_row_major_rows(model)` times
both paths on the model's own products at 1, 2, ... `ROW_MAJOR_MAX_ROWS`
rows and keeps the row-major path up to the last row count where it wins
by a clear margin (`_MARGIN`; in doubt the blocked path, which larger steps
take anyway).

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
import torch.nn.functional as F

from models.layers.fused_linear import ROW_MAJOR_MAX_ROWS, FusedLinear

logger = logging.getLogger(__name__)

_MIN_BYTES = 8 << 20
_TIMED_BYTES = 256 << 20
_REPEATS = 3
# The row-major path is kept only where its best pass is this much faster.
_MARGIN = 0.95

PATHS = ("blocked", "row-major")
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


def run_pass(products: Sequence[FusedLinear], inputs: dict[int, torch.Tensor], path: str) -> float:
    """Seconds for one product per entry of `products` on `path`, the
    input of each taken from `inputs` by its width."""
    start = time.perf_counter()
    for fused in products:
        x = inputs[fused.weight.shape[1]]
        if path == "blocked":
            fused.packed_matmul(x)
        else:
            F.linear(x, fused.weight, fused.bias)
    return time.perf_counter() - start


def row_major_limit(
    time_pass: PassTimer, max_rows: int = ROW_MAJOR_MAX_ROWS
) -> tuple[int, dict[int, dict[str, float]]]:
    """The most rows up to which the row-major path is kept, and the best
    pass of each path at every row count tried: row counts 1, 2, ... in
    turn, and the first where the row-major pass is not `_MARGIN` faster
    ends the search."""
    limit, best = 0, {}
    for rows in range(1, max_rows + 1):
        best[rows] = _best_passes(time_pass, rows)
        if best[rows]["row-major"] >= _MARGIN * best[rows]["blocked"]:
            break
        limit = rows
    return limit, best


def _best_passes(time_pass: PassTimer, rows: int) -> dict[str, float]:
    """Each path's best of `_REPEATS` passes, alternating, after a warm-up
    pass of each (first touches, oneDNN's primitive)."""
    for path in PATHS:
        time_pass(rows, path)
    seconds: dict[str, list[float]] = {path: [] for path in PATHS}
    for _ in range(_REPEATS):
        for path in PATHS:
            seconds[path].append(time_pass(rows, path))
    return {path: min(s) for path, s in seconds.items()}


def choose_row_major_rows(model: torch.nn.Module) -> int | None:
    """Measure the paths on `model`'s fp32 products and set every product's
    `row_major_max_rows`; returns the limit, or None where nothing was
    measured (no packed fp32 products, or under `_MIN_BYTES` of them)."""
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
        limit, best = row_major_limit(time_pass)
    for fused in products:
        fused.row_major_max_rows = limit
    logger.info(
        "fp32 products of a few rows, best pass over %d products (%.0f MiB): %s; "
        "row-major path up to %d rows",
        len(timed),
        total / 2**20,
        ", ".join(
            f"{rows} rows {1e3 * p['row-major']:.2f} ms row-major / {1e3 * p['blocked']:.2f} blocked"
            for rows, p in best.items()
        ),
        limit,
    )
    return limit
