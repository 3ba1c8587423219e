"""The tables `benchmarks.serve_compare` prints: one row per server and rate
(`vllm bench serve`'s own metrics), the ratios of ours over vLLM's for each
pair of servers and rate, our served over our offline throughput, and the
CPU-seconds line of a rate's progress. Its cells and tables
(`markdown_table`, `ms_pair`, `tok_s_cell`, `ratio`) are
`benchmarks.spec_report`'s too."""

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
    # Per request (e2e - TTFT) / (output tokens - 1): where a chunk carries
    # several tokens (speculative decoding), the ITL above is per chunk, this per token.
    tpot_p50: float = math.nan
    tpot_p99: float = math.nan

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
            tpot_p50=float(result.get("p50_tpot_ms", math.nan)),
            tpot_p99=float(result.get("p99_tpot_ms", math.nan)),
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
    header = (
        "server",
        "prefix cache",
        "rate",
        "out tok/s",
        "TTFT p50 / p99 ms",
        "ITL p50 / p99 ms",
    )
    return markdown_table(header, [_row_cells(row) for row in rows])


def _row_cells(row: Row) -> list[str]:
    head = [row.label, "on" if row.prefix_cache else "off", row.rate]
    m = row.result
    if m is None:
        return [*head, f"failed: {row.error}"]
    return [
        *head,
        tok_s_cell(m, 0),
        ms_pair(m.ttft_p50, m.ttft_p99, 0),
        ms_pair(m.itl_p50, m.itl_p99, 1),
    ]


def markdown_table(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    """`header`, its rule and one line per cell list; a short list (a failed
    row) is padded with empty cells to the header's width."""
    width = len(header)

    def line(cells: Sequence[str]) -> str:
        padded = [*cells, *[""] * (width - len(cells))]
        return "|" + "|".join(f" {c} " if c else " " for c in padded) + "|"

    return "\n".join([line(header), "|" + "---|" * width, *(line(cells) for cells in lines)])


def ms_cell(value: float, digits: int) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def ms_pair(p50: float, p99: float, digits: int) -> str:
    """ "p50 / p99", '-' for a latency the row has not (NaN)."""
    return f"{ms_cell(p50, digits)} / {ms_cell(p99, digits)}"


def tok_s_cell(m: Measurement, digits: int) -> str:
    """Output tok/s, with the requests that failed where any did."""
    lost = f" ({m.failed} failed)" if m.failed else ""
    return f"{m.output_tok_s:.{digits}f}{lost}"


# A latency below this (ms) is no base for a ratio: vLLM's client reports an
# ITL p50 of 0.0 when a server's tokens arrive several to one network read.
MIN_RATIO_BASE = 0.5


def ratio_value(ours: float, theirs: float) -> float | None:
    """ours / theirs; None where `theirs` is no base for one (below
    `MIN_RATIO_BASE`, or NaN)."""
    return ours / theirs if theirs >= MIN_RATIO_BASE else None


def ratio(ours: float, theirs: float) -> str:
    value = ratio_value(ours, theirs)
    return "-" if value is None else f"{value:.2f}x"


def format_ratios(rows: Sequence[Row]) -> str:
    """ours / vLLM per pair and rate: tok/s (higher is better), latencies (lower is better)."""
    by_key = {(r.key, r.rate): r.result for r in rows if r.result is not None}
    rates = list(dict.fromkeys(r.rate for r in rows))
    header = ("ours / vLLM", "rate", "out tok/s (higher better)", "TTFT p50 / p99", "ITL p50 / p99")
    lines = []
    for ours_key, vllm_key in PAIRS:
        for rate in rates:
            ours, theirs = by_key.get((ours_key, rate)), by_key.get((vllm_key, rate))
            if ours is None or theirs is None:
                continue
            lines.append(
                [
                    f"{ours_key} / {vllm_key}",
                    rate,
                    ratio(ours.output_tok_s, theirs.output_tok_s),
                    f"{ratio(ours.ttft_p50, theirs.ttft_p50)} / {ratio(ours.ttft_p99, theirs.ttft_p99)}",
                    f"{ratio(ours.itl_p50, theirs.itl_p50)} / {ratio(ours.itl_p99, theirs.itl_p99)}",
                ]
            )
    served, offline = by_key.get(("ours-agg", "inf")), by_key.get((OFFLINE, "inf"))
    if served is not None and offline is not None:
        tok_s = ratio(served.output_tok_s, offline.output_tok_s)
        lines.append([f"ours-agg served / {OFFLINE}", "inf", tok_s])
    return markdown_table(header, lines)


def format_cpu(by_name: dict[str, float], shown: int = 3) -> str:
    """ "server 3.42 (ray::GenerationW 2.47, python 0.63, raylet 0.09, 4 more 0.23)"."""
    named = list(by_name.items())
    parts = [f"{name} {cpu:.2f}" for name, cpu in named[:shown]]
    if len(named) > shown:
        parts.append(f"{len(named) - shown} more {sum(cpu for _, cpu in named[shown:]):.2f}")
    return f"server {sum(by_name.values()):.2f} ({', '.join(parts)})"
