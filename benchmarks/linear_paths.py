"""A model's linear products on each CPU path, at decode-sized row counts.

Loads a checkpoint as a worker does (fused and prepacked, `FusedLinear`),
then for each row count times one pass over every fused product of the
model in layer order, as a decode step reads them (weights streamed from
memory, not from cache, for any model larger than the cache), on each path:
oneDNN's blocked copy of the weights, the row-major weight through
`F.linear`, and the row-major weight through the few-row C kernel (up to its
most rows, where it is built). Passes alternate between the paths, so load
from other processes hits them alike; the median pass is printed, with the
path `FusedLinear` takes at that row count (what the loader measured on
this CPU, see `models.layers.small_products`). It runs in the environment
served CPU workers start with (`engine.process_env`), re-executing itself if
needed.
What it is for: checking the loader's choice of path on another CPU against
more passes and more row counts.

    python -m benchmarks.linear_paths --model smollm2 --rows 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.process_env import run_in_cpu_engine_env
from models.layers.fused_linear import ROW_MAJOR
from models.layers.small_products import PATHS, fusions, paths_at, run_pass
from models.loader import load_model


@dataclass
class RowResult:
    rows: int
    chosen: str  # the path FusedLinear takes at this row count
    seconds: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PATHS})

    def line(self) -> str:
        times = "  ".join(
            f"{path} {statistics.median(self.seconds[path]) * 1e3:8.2f} ms" for path in self.paths
        )
        return f"{self.rows:5d} rows: {times}   (FusedLinear: {self.chosen})"

    @property
    def paths(self) -> list[str]:
        return [path for path in PATHS if self.seconds[path]]


def measure(checkpoint: Path, dtype: str, rows: list[int], reps: int) -> list[RowResult]:
    """Median pass per path and row count, the first (warm-up) pass of each left out."""
    model, _ = load_model(checkpoint, dtype=dtype)
    products = fusions(model)
    if not products:
        raise SystemExit(f"{checkpoint}: no prepacked products (dtype {dtype} on this CPU?)")
    widths = {f.weight.shape[1] for f in products}
    results = []
    for count in rows:
        inputs = {w: torch.randn(count, w, dtype=products[0].weight.dtype) for w in widths}
        x = inputs[products[0].weight.shape[1]]
        result = RowResult(count, products[0].path_for(x))
        # The row-major path at any row count; the few-row kernel where it serves.
        paths = [path for path in PATHS if path == ROW_MAJOR or path in paths_at(count)]
        with torch.inference_mode():
            for rep in range(reps + 1):
                for path in paths:
                    seconds = run_pass(products, inputs, path)
                    if rep:
                        result.seconds[path].append(seconds)
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local HF folder, or 'smollm2' (default: the anchor)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    parser.add_argument("--reps", type=int, default=7, help="timed passes per path and row count")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    run_in_cpu_engine_env(__spec__.name, argv)
    from benchmarks.serve_compare import resolve_model

    torch.set_num_threads(args.threads)
    checkpoint = resolve_model(args.model)
    print(f"{checkpoint.name}, {args.dtype}, {args.threads} threads, one pass over every product")
    for result in measure(checkpoint, args.dtype, args.rows, args.reps):
        print("  " + result.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
