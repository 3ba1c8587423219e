"""Rows of the GPU check's report: how each was run, a failure row, the printed table.

Every row carries `run`: `cuda` (run on the GPU), `cpu-run` (run under
`--device cpu`, the same code path on CPU tensors) or `needs-cuda` (listed
under `--device cpu` so the CPU run shows every check the GPU run makes,
but not run: it needs the device, such as a CUDA-graph replay or a compiled
Triton kernel). A `needs-cuda` row is not a failure.
"""

from __future__ import annotations

import traceback
from typing import Any

CUDA_RUN, CPU_RUN, NEEDS_CUDA = "cuda", "cpu-run", "needs-cuda"


def failure_row(error: BaseException) -> dict[str, Any]:
    """A failed row naming the error, with its traceback for the JSON report."""
    trace = traceback.format_exception(type(error), error, error.__traceback__)
    return {"error": f"{type(error).__name__}: {error}", "traceback": "".join(trace), "ok": False}


def needs_cuda(check: str, **fields: Any) -> dict[str, Any]:
    """A check the GPU run makes that a CPU run lists without running."""
    return {"check": check, **fields, "run": NEEDS_CUDA, "ok": True}


def mark_run(rows: list[dict[str, Any]], device: str) -> list[dict[str, Any]]:
    """Mark the rows that do not say otherwise as run on `device`."""
    for row in rows:
        row.setdefault("run", CUDA_RUN if device == "cuda" else CPU_RUN)
    return rows


def table(report: dict[str, Any]) -> str:
    lines = []
    skipped = 0
    for part, rows in report["parts"].items():
        lines.append(f"== {part}")
        for row in rows:
            cells = [
                f"{k}={_fmt(v)}" for k, v in row.items() if k not in ("ok", "traceback", "run")
            ]
            status = "ok  " if row["ok"] else "FAIL"
            run = row.get("run", "?")
            skipped += run == NEEDS_CUDA
            lines.append(f"  {status} [{run}] " + "  ".join(cells))
    lines.append(f"forbidden modules imported: {report['forbidden_modules'] or 'none'}")
    if skipped:
        lines.append(f"{skipped} checks need CUDA: run `python -m benchmarks.gpu_check` on a GPU")
    lines.append(f"total {report['seconds']:.1f} s: {'ALL OK' if report['ok'] else 'FAILED'}")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
