"""Latency and throughput statistics of one benchmark run (pure Python).

Per request the load generator records when it was sent, when each streamed
chunk arrived and how many output tokens it produced. From those:

- TTFT: send -> first chunk with text;
- ITL: gaps between consecutive chunks (split evenly over the tokens of a
  multi-token chunk);
- TPOT: (e2e - TTFT) / (output tokens - 1), per request;
- E2E: send -> last chunk;
- goodput: requests per second that met every given SLO (the table shows
  it only when one is given: with none, every completed request counts);
- tokens: the prompt and output tokens of the completed requests, total
  and mean (the server's usage counts where it sends them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """Timestamps (seconds, one monotonic clock) of one benchmark request."""

    sent: float
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.sent

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        gaps: list[float] = []
        for i in range(1, len(self.chunk_times)):
            tokens = max(1, self.chunk_tokens[i] if i < len(self.chunk_tokens) else 1)
            gap = (self.chunk_times[i] - self.chunk_times[i - 1]) / tokens
            gaps.extend([gap] * tokens)
        return gaps


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in seconds; None means not checked."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        tpot = record.tpot
        return (
            (self.ttft_s is None or record.ttft <= self.ttft_s)
            and (self.tpot_s is None or tpot is None or tpot <= self.tpot_s)
            and (self.e2e_s is None or record.e2e <= self.e2e_s)
        )


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Sequence[float]) -> dict[str, float]:
    """mean and p50/p90/p99, in milliseconds."""
    summary = {"mean_ms": (sum(values) / len(values) * 1000) if values else math.nan}
    for q in PERCENTILES:
        summary[f"p{q}_ms"] = percentile(values, q) * 1000
    return summary


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO) -> dict[str, Any]:
    """The whole run as one JSON-ready dict."""
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    good = sum(1 for r in ok if slo.met_by(r))
    duration = max(duration_s, 1e-9)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration,
        "goodput": good / duration,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "e2e_s": slo.e2e_s},
        "prompt_tokens": token_counts([r.prompt_tokens for r in ok]),
        "output_tokens": token_counts([r.output_tokens for r in ok]),
        "ttft": distribution([r.ttft for r in ok]),
        "tpot": distribution([t for r in ok if (t := r.tpot) is not None]),
        "itl": distribution([gap for r in ok for gap in r.itls()]),
        "e2e": distribution([r.e2e for r in ok]),
    }


def token_counts(counts: Sequence[int]) -> dict[str, float]:
    """total and mean of per-request token counts (mean NaN for none)."""
    total = sum(counts)
    return {"total": total, "mean": total / len(counts) if counts else math.nan}


def format_summary(summary: dict[str, Any]) -> str:
    """A human-readable table of `summarize`'s result."""
    prompt, output = summary["prompt_tokens"], summary["output_tokens"]
    lines = [
        f"requests        {summary['completed']}/{summary['requests']} ok "
        f"in {summary['duration_s']:.2f}s",
        f"tokens          prompt {prompt['total']:,} ({prompt['mean']:.1f} mean), "
        f"output {output['total']:,} ({output['mean']:.1f} mean)",
        f"throughput      {summary['request_throughput']:.2f} req/s, "
        f"{summary['output_token_throughput']:.1f} output tok/s, "
        f"{summary['total_token_throughput']:.1f} total tok/s",
    ]
    if any(limit is not None for limit in summary["slo"].values()):
        lines.append(f"goodput         {summary['goodput']:.2f} req/s within the SLOs")
    lines.append(f"{'':15} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}   (ms)")
    for name in ("ttft", "tpot", "itl", "e2e"):
        d = summary[name]
        cells = " ".join(f"{d[k]:9.2f}" for k in ("mean_ms", "p50_ms", "p90_ms", "p99_ms"))
        lines.append(f"{name.upper():15} {cells}")
    for error in summary["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)
