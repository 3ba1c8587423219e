"""Rows of the GPU check's report: a failure row, and the printed table."""

from __future__ import annotations

import traceback
from typing import Any


def failure_row(error: BaseException) -> dict[str, Any]:
    """A failed row naming the error, with its traceback for the JSON report."""
    trace = traceback.format_exception(type(error), error, error.__traceback__)
    return {"error": f"{type(error).__name__}: {error}", "traceback": "".join(trace), "ok": False}


def table(report: dict[str, Any]) -> str:
    lines = []
    for part, rows in report["parts"].items():
        lines.append(f"== {part}")
        for row in rows:
            cells = [f"{k}={_fmt(v)}" for k, v in row.items() if k not in ("ok", "traceback")]
            lines.append(f"  {'ok  ' if row['ok'] else 'FAIL'} " + "  ".join(cells))
    lines.append(f"forbidden modules imported: {report['forbidden_modules'] or 'none'}")
    lines.append(f"total {report['seconds']:.1f} s: {'ALL OK' if report['ok'] else 'FAILED'}")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
