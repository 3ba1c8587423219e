"""`disagg bench --plot`: latency percentiles and per-request token timelines.

    TTFT   TPOT   ITL    E2E        one panel each, on its own millisecond
    ▮▮▮    ▮▮▮    ▮▮▮    ▮▮▮        scale: ITL (tens of ms) beside E2E
    ───────────────────────────     (seconds) would be a flat line
    tokens over time, one line per request

matplotlib is a project dependency; an environment installed without it
gets `PlotUnavailableError` saying how to add it, not a traceback.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cluster.bench.stats import PERCENTILES, RequestRecord

LATENCIES = ("ttft", "tpot", "itl", "e2e")


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed."""


def plot_run(records: Sequence[RequestRecord], summary: dict[str, Any], out_path: str) -> None:
    """Write `run_figure` to `out_path` (PNG)."""
    plt = _pyplot()
    figure = run_figure(records, summary)
    figure.savefig(out_path, dpi=120)
    plt.close(figure)


def run_figure(records: Sequence[RequestRecord], summary: dict[str, Any]) -> Any:
    """Top: TTFT / TPOT / ITL / E2E percentiles, one axis each. Bottom:
    every request's tokens over time (one line per request, from send to
    last token). Returns the matplotlib Figure."""
    plt = _pyplot()
    figure = plt.figure(figsize=(13, 7))
    grid = figure.add_gridspec(2, len(LATENCIES), height_ratios=(1, 1.3))
    for column, name in enumerate(LATENCIES):
        _latency_panel(figure.add_subplot(grid[0, column]), name, summary[name])
    _timelines(figure.add_subplot(grid[1, :]), records)
    figure.tight_layout()
    return figure


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; no display needed
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailableError(
            "--plot needs matplotlib; install it with `pip install matplotlib`"
        ) from exc
    return plt


def _latency_panel(axis: Any, name: str, distribution: dict[str, float]) -> None:
    labels = [f"p{q}" for q in PERCENTILES]
    axis.bar(labels, [distribution[f"{label}_ms"] for label in labels], color="tab:blue")
    axis.set_title(name.upper())
    axis.set_ylabel("milliseconds")


def _timelines(axis: Any, records: Sequence[RequestRecord]) -> None:
    start = min((r.sent for r in records), default=0.0)
    for record in records:
        if not record.ok:
            continue
        times = [record.sent - start] + [t - start for t in record.chunk_times]
        counts = [0]
        for tokens in record.chunk_tokens:
            counts.append(counts[-1] + tokens)
        axis.plot(times, counts, linewidth=0.8, alpha=0.7)
    axis.set_xlabel("seconds since the first request")
    axis.set_ylabel("output tokens")
    axis.set_title("token timelines (one line per request)")
