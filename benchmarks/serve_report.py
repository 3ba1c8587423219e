"""The tables `benchmarks.serve_compare` prints: one row per server and rate
(`vllm bench serve`'s own metrics), the ratios of ours over vLLM's for each
pair of servers and rate, our served over our offline throughput, and the
CPU-seconds line of a rate's progress."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from benchmarks.serve_targets import OFFLINE, PAIRS


@dataclass(frozen=True)
class Measurement:
    """One `vllm bench serve` run, in its own metric names' units (ms, tok/s).
    The offline row has no latencies (NaN)."""

    output_tok_s: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    completed: int
    failed: int
    duration_s: float = math.nan  # from the first request sent to the last answer

    @classmethod
    def from_result(cls, result: dict[str, float]) -> Measurement:
        return cls(
            output_tok_s=float(result["output_throughput"]),
            ttft_p50=float(result["p50_ttft_ms"]),
            ttft_p99=float(result["p99_ttft_ms"]),
            itl_p50=float(result["p50_itl_ms"]),
            itl_p99=float(result["p99_itl_ms"]),
            completed=int(result["completed"]),
            failed=int(result["failed"]),
            duration_s=float(result.get("duration", math.nan)),
        )


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    rate: str
    prefix_cache: bool
    result: Measurement | None  # None: the server or the client failed
    error: str = ""
    # CPU-seconds the server's processes took while the client ran, by process name.
    server_cpu: dict[str, float] = field(default_factory=dict)


def format_table(rows: Sequence[Row]) -> str:
    header = "| server | prefix cache | rate | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms |"
    lines = [header, "|---|---|---|---|---|---|"]
    for row in rows:
        cache = "on" if row.prefix_cache else "off"
        m = row.result
        if m is None:
            lines.append(f"| {row.label} | {cache} | {row.rate} | failed: {row.error} | | |")
            continue
        lost = f" ({m.failed} failed)" if m.failed else ""
        lines.append(
            f"| {row.label} | {cache} | {row.rate} | {m.output_tok_s:.0f}{lost} | "
            f"{_ms(m.ttft_p50, 0)} / {_ms(m.ttft_p99, 0)} | "
            f"{_ms(m.itl_p50, 1)} / {_ms(m.itl_p99, 1)} |"
        )
    return "\n".join(lines)


def _ms(value: float, digits: int) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


# A latency below this (ms) is no base for a ratio: vLLM's client reports an
# ITL p50 of 0.0 when a server's tokens arrive several to one network read.
MIN_RATIO_BASE = 0.5


def ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs >= MIN_RATIO_BASE else "-"


def format_ratios(rows: Sequence[Row]) -> str:
    """ours / vLLM per pair and rate: tok/s (higher is better), latencies (lower is better)."""
    by_key = {(r.key, r.rate): r.result for r in rows if r.result is not None}
    rates = list(dict.fromkeys(r.rate for r in rows))
    lines = [
        "| ours / vLLM | rate | out tok/s (higher better) | TTFT p50 / p99 | ITL p50 / p99 |",
        "|---|---|---|---|---|",
    ]
    for ours_key, vllm_key in PAIRS:
        for rate in rates:
            ours, theirs = by_key.get((ours_key, rate)), by_key.get((vllm_key, rate))
            if ours is None or theirs is None:
                continue
            lines.append(
                f"| {ours_key} / {vllm_key} | {rate} | "
                f"{ratio(ours.output_tok_s, theirs.output_tok_s)} | "
                f"{ratio(ours.ttft_p50, theirs.ttft_p50)} / {ratio(ours.ttft_p99, theirs.ttft_p99)} | "
                f"{ratio(ours.itl_p50, theirs.itl_p50)} / {ratio(ours.itl_p99, theirs.itl_p99)} |"
            )
    served, offline = by_key.get(("ours-agg", "inf")), by_key.get((OFFLINE, "inf"))
    if served is not None and offline is not None:
        lines.append(
            f"| ours-agg served / {OFFLINE} | inf | "
            f"{ratio(served.output_tok_s, offline.output_tok_s)} | | |"
        )
    return "\n".join(lines)


def format_cpu(by_name: dict[str, float], shown: int = 3) -> str:
    """ "server 3.42 (ray::GenerationW 2.47, python 0.63, raylet 0.09, 4 more 0.23)"."""
    named = list(by_name.items())
    parts = [f"{name} {cpu:.2f}" for name, cpu in named[:shown]]
    if len(named) > shown:
        parts.append(f"{len(named) - shown} more {sum(cpu for _, cpu in named[shown:]):.2f}")
    return f"server {sum(by_name.values()):.2f} ({', '.join(parts)})"
