"""`disagg bench --plot`: latency percentiles and per-request token timelines.

matplotlib is a project dependency; an environment installed without it
gets `PlotUnavailableError` saying how to add it, not a traceback.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cluster.bench.stats import PERCENTILES, RequestRecord


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed."""


def plot_run(records: Sequence[RequestRecord], summary: dict[str, Any], out_path: str) -> None:
    """Left: TTFT / TPOT / ITL / E2E percentiles. Right: every request's
    tokens over time (one line per request, from send to last token)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; no display needed
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailableError(
            "--plot needs matplotlib; install it with `pip install matplotlib`"
        ) from exc
    figure, (latency, timeline) = plt.subplots(1, 2, figsize=(13, 5))
    names = ("ttft", "tpot", "itl", "e2e")
    width = 0.8 / len(PERCENTILES)
    for k, q in enumerate(PERCENTILES):
        values = [summary[name][f"p{q}_ms"] for name in names]
        positions = [i + (k - 1) * width for i in range(len(names))]
        latency.bar(positions, values, width, label=f"p{q}")
    latency.set_xticks(range(len(names)), [n.upper() for n in names])
    latency.set_ylabel("milliseconds")
    latency.set_title("latency percentiles")
    latency.legend()
    start = min((r.sent for r in records), default=0.0)
    for record in records:
        if not record.ok:
            continue
        times = [record.sent - start] + [t - start for t in record.chunk_times]
        counts = [0]
        for tokens in record.chunk_tokens:
            counts.append(counts[-1] + tokens)
        timeline.plot(times, counts, linewidth=0.8, alpha=0.7)
    timeline.set_xlabel("seconds since the first request")
    timeline.set_ylabel("output tokens")
    timeline.set_title("token timelines (one line per request)")
    figure.tight_layout()
    figure.savefig(out_path, dpi=120)
    plt.close(figure)
