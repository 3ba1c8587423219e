"""A GPU check of the serving path that needs nothing but torch, triton and
transformers: no Ray, NIXL or pydantic.

    python -m benchmarks.gpu_check                 # --device cuda when CUDA is there
    python -m benchmarks.gpu_check --device cpu    # the same code paths on CPU (smoke)

Six parts, each a list of rows with an `ok` field:

1. models: Llama, Nemotron-H and the Omni VL wrapper against transformers on
   the device, fp32 logits within 1e-4 of the logit scale, bf16 greedy
   agreement reported, Llama's decode steps replayed from CUDA graphs in
   both dtypes (`parity.py`);
2. engine: continuous batching with chunked prefill and preemption on the
   device, greedy tokens equal to a CPU fp32 run, eagerly and from CUDA
   graphs (`engine_run.py`);
3. kernels: every Triton kernel, compiled, against its `_ref` twin in fp32
   and bf16 (`kernels.py`);
4. transfer: a cache transfer between two processes through the Python
   transceiver, exact bytes, GB/s against a raw copy and raw loopback TCP
   (`transfer_run.py`), and a tensor-parallel head-sliced (strided) pull
   staged through host memory (`sliced_transfer.py`);
5. sizing: two instances sharing the GPU at `num_gpus: 0.5`, sized by the
   workers' own reckoning, their measured footprints against their shares
   (`sizing.py`);
6. throughput: decode tokens/s per batch size on the `small` checkpoint in
   bf16, with the step time split (`throughput.py`).

Writes one JSON report (`--out`) and prints a short table; exits 1 if any
row failed. Every row is marked `cuda`, `cpu-run` or `needs-cuda`
(`report.py`). Under `--device cpu` the Triton kernels run in the
interpreter and are forced for CPU tensors, so the layers take the code
paths CUDA tensors take; sizes and batch lists shrink to keep it a smoke
test, and what only a GPU can run (CUDA-graph replays, compiled and bf16
kernels, two processes sharing a device) is listed as `needs-cuda`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.gpu_check.report import failure_row, mark_run, table

GPU_BATCH_SIZES = [1, 8, 32, 128, 256]
CPU_BATCH_SIZES = [1, 4]
FORBIDDEN_PACKAGES = ("ray", "nixl", "pydantic")
PARTS = ("models", "engine", "kernels", "transfer", "sizing", "throughput")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available"
    )
    parser.add_argument("--out", type=Path, default=Path("gpu_check_report.json"))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument(
        "--checkpoints", type=Path, default=None, help="folder for the embedded checkpoints"
    )
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=PARTS,
    )
    return parser.parse_args(argv)


def _prepare_environment(device: str) -> None:
    """On CPU: kernels in the Triton interpreter, forced for CPU tensors. Must
    run before the first import of triton (the project's modules import it)."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["DISAGG_FORCE_TRITON"] = "1"


def _run_parts(args: argparse.Namespace, device: str, root: Path) -> dict[str, Any]:
    from benchmarks.gpu_check.engine_run import check_engine
    from benchmarks.gpu_check.engine_setup import checkpoint
    from benchmarks.gpu_check.kernels import DTYPES as KERNEL_DTYPES
    from benchmarks.gpu_check.kernels import check_kernels
    from benchmarks.gpu_check.parity import check_models
    from benchmarks.gpu_check.sizing import check_sizing
    from benchmarks.gpu_check.sliced_transfer import check_sliced_transfer
    from benchmarks.gpu_check.throughput import check_throughput
    from benchmarks.gpu_check.transfer_run import check_transfer

    on_gpu = device == "cuda"
    parts: dict[str, Any] = {}
    timings: dict[str, float] = {}
    plan = {
        "models": lambda: check_models(root, device, steps=16 if on_gpu else 3),
        "engine": lambda: check_engine(root, device, new_tokens=12 if on_gpu else 3),
        "kernels": lambda: check_kernels(
            device, scale=8 if on_gpu else 1, dtypes=KERNEL_DTYPES if on_gpu else ("float32",)
        ),
        "transfer": lambda: [
            _row(lambda: check_transfer(device, num_blocks=128 if on_gpu else 8)),
            _row(lambda: check_sliced_transfer(device, num_blocks=64 if on_gpu else 4)),
        ],
        "sizing": lambda: check_sizing(root, device),
        "throughput": lambda: check_throughput(
            checkpoint(root, "llama", "small" if on_gpu else "tiny"),
            device,
            "bfloat16" if on_gpu else "float32",
            args.batch_sizes or (GPU_BATCH_SIZES if on_gpu else CPU_BATCH_SIZES),
            steps=64 if on_gpu else 3,
        ),
    }
    for name, run in plan.items():
        if name in args.skip:
            continue
        start = time.perf_counter()
        try:
            parts[name] = run()
        except Exception as error:  # one broken part must not lose the others' report
            parts[name] = [failure_row(error)]
        mark_run(parts[name], device)
        timings[name] = time.perf_counter() - start
        print(f"[gpu_check] {name}: {timings[name]:.1f} s", file=sys.stderr, flush=True)
    return {"parts": parts, "part_seconds": timings}


def _row(check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One row, or its failure row: a row that raises loses none of its part's others."""
    try:
        return check()
    except Exception as error:
        return failure_row(error)


def _environment(device: str) -> dict[str, Any]:
    import torch
    import triton

    return {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    _prepare_environment(args.device)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch:
        root = args.checkpoints or Path(scratch)
        report = {"environment": _environment(args.device), **_run_parts(args, args.device, root)}
    report["seconds"] = time.perf_counter() - start
    report["forbidden_modules"] = sorted(
        {m.split(".")[0] for m in sys.modules} & set(FORBIDDEN_PACKAGES)
    )
    report["ok"] = not report["forbidden_modules"] and all(
        row["ok"] for rows in report["parts"].values() for row in rows
    )
    args.out.write_text(json.dumps(report, indent=2))
    print(table(report))
    print(f"report: {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
