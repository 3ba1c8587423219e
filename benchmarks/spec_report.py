"""The tables `benchmarks.spec_compare` prints: one row per mode, server,
workload and rate; ours-on over ours-off and over vLLM; the goals.

Two decode latencies, both from `vllm bench serve`:

- ITL: the gaps between streamed chunks, as vLLM's client measures them. A
  verify step that accepts drafts sends its tokens in one chunk (ours and
  vLLM's alike), so with speculation on this is the time per *step*, and it
  rises;
- TPOT: per request (e2e - TTFT) / (output tokens - 1), the time per output
  *token*, which is what speculation shortens.

The goals on decode latency are therefore read on TPOT (`TPOT_NOTE`, printed
under the goals); ITL is shown beside it for what a chunk costs. The cells
and the table itself are `benchmarks.serve_report`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.serve_report import (
    Measurement,
    markdown_table,
    ms_pair,
    ratio,
    ratio_value,
    tok_s_cell,
)
from cluster.bench.speculation import SpecTotals

OURS_OFF, OURS_ON, VLLM_ON = "ours-off", "ours-on", "vllm-ngram"
SERVERS = (OURS_OFF, OURS_ON, VLLM_ON)
COPY, ANCHOR = "copy", "anchor"
WORKLOADS = (COPY, ANCHOR)
# What ours-on is compared with, for the ratios table.
COUNTERPARTS = (OURS_OFF, VLLM_ON)
TPOT_NOTE = (
    "The decode-latency goals are read on TPOT p50, the time per output token "
    "((e2e - TTFT) / (output tokens - 1) per request), not on ITL: vLLM's client "
    "measures ITL per streamed chunk, and a verify step streams its accepted "
    "tokens as one chunk, so with speculation ITL rises while TPOT falls."
)


@dataclass(frozen=True)
class SpecRow:
    mode: str  # "agg" or "1p1d"
    server: str  # one of SERVERS
    label: str
    workload: str  # one of WORKLOADS
    rate: str
    result: Measurement | None  # None: the server or the client failed
    spec: SpecTotals | None = None  # what the run drafted; None: no such metrics
    error: str = ""


@dataclass(frozen=True)
class Goal:
    """ours-on over `other` on `workload`, in `metric` (a `Measurement`
    field), at most (`at_most`) or at least `bound`."""

    workload: str
    other: str
    metric: str
    metric_name: str  # for the header
    bound: float
    at_most: bool

    @property
    def header(self) -> str:
        sign = "<=" if self.at_most else ">="
        return f"{self.workload}: on / {self.other} {self.metric_name} (goal {sign} {self.bound})"

    def value(self, ours: Measurement | None, other: Measurement | None) -> float | None:
        if ours is None or other is None:
            return None
        return ratio_value(getattr(ours, self.metric), getattr(other, self.metric))

    def verdict(self, value: float | None) -> str:
        if value is None:
            return "-"
        met = value <= self.bound if self.at_most else value >= self.bound
        return f"{value:.2f}x ({'meets' if met else 'misses'})"


GOALS = (
    Goal(COPY, OURS_OFF, "tpot_p50", "TPOT p50", 0.7, at_most=True),
    Goal(COPY, VLLM_ON, "tpot_p50", "TPOT p50", 1.0, at_most=True),
    Goal(ANCHOR, OURS_OFF, "output_tok_s", "out tok/s", 0.95, at_most=False),
)


def _spec_cells(spec: SpecTotals | None) -> list[str]:
    if spec is None:
        return ["-", "-"]  # the server has no speculation metrics
    rate, length = spec.acceptance_rate, spec.mean_accepted_length
    if rate is None or length is None:
        return ["no drafts", "-"]
    return [f"{rate:.1%}", f"{length:.2f}"]


def _row_cells(row: SpecRow) -> list[str]:
    head = [row.mode, row.server, row.workload, row.rate]
    m = row.result
    if m is None:
        return [*head, f"failed: {row.error}"]
    return [
        *head,
        ms_pair(m.itl_p50, m.itl_p99, 1),
        ms_pair(m.tpot_p50, m.tpot_p99, 1),
        ms_pair(m.ttft_p50, m.ttft_p99, 0),
        tok_s_cell(m, 1),
        *_spec_cells(row.spec),
    ]


def format_table(rows: Sequence[SpecRow]) -> str:
    header = (
        *("mode", "server", "workload", "rate"),
        *("ITL p50 / p99 ms (per chunk)", "TPOT p50 / p99 ms (per token)", "TTFT p50 / p99 ms"),
        *("out tok/s", "acceptance", "mean accepted length"),
    )
    return markdown_table(header, [_row_cells(row) for row in rows])


def _by_key(rows: Sequence[SpecRow]) -> dict[tuple[str, str, str, str], Measurement]:
    return {(r.mode, r.server, r.workload, r.rate): r.result for r in rows if r.result is not None}


def format_ratios(rows: Sequence[SpecRow]) -> str:
    """Per mode, workload and rate: ours-on over ours-off and over vLLM, in
    TPOT p50, ITL p50, TTFT p50 (lower is better) and out tok/s (higher)."""
    by = _by_key(rows)
    header = (
        *("mode", "workload", "rate", "ratio", "TPOT p50 (per token)", "ITL p50 (per chunk)"),
        *("TTFT p50", "out tok/s (higher better)"),
    )
    lines = []
    for mode, workload, rate in dict.fromkeys((r.mode, r.workload, r.rate) for r in rows):
        ours = by.get((mode, OURS_ON, workload, rate))
        for other in COUNTERPARTS:
            theirs = by.get((mode, other, workload, rate))
            if ours is None or theirs is None:
                continue
            lines.append(
                [
                    *(mode, workload, rate, f"{OURS_ON} / {other}"),
                    ratio(ours.tpot_p50, theirs.tpot_p50),
                    ratio(ours.itl_p50, theirs.itl_p50),
                    ratio(ours.ttft_p50, theirs.ttft_p50),
                    ratio(ours.output_tok_s, theirs.output_tok_s),
                ]
            )
    return markdown_table(header, lines)


def format_goals(rows: Sequence[SpecRow]) -> str:
    """Per mode and rate, each of `GOALS` with its ratio and whether it is
    met, then `TPOT_NOTE`."""
    by = _by_key(rows)
    lines = []
    for mode, rate in dict.fromkeys((r.mode, r.rate) for r in rows):
        cells = [mode, rate]
        for goal in GOALS:
            ours = by.get((mode, OURS_ON, goal.workload, rate))
            other = by.get((mode, goal.other, goal.workload, rate))
            cells.append(goal.verdict(goal.value(ours, other)))
        lines.append(cells)
    table = markdown_table(("mode", "rate", *(goal.header for goal in GOALS)), lines)
    return f"{table}\n\n{TPOT_NOTE}"


def format_labels(rows: Sequence[SpecRow]) -> str:
    """What each (mode, server) ran, once."""
    seen = dict.fromkeys((r.mode, r.server, r.label) for r in rows)
    return "\n".join(f"  {mode} {server}: {label}" for mode, server, label in seen)


def format_failures(rows: Sequence[SpecRow]) -> str:
    """One line per (mode, server) that failed, with why; '' when none did."""
    failed = dict.fromkeys((r.mode, r.server, r.error) for r in rows if r.result is None)
    return "\n".join(f"  {mode} {server} failed: {error}" for mode, server, error in failed)
