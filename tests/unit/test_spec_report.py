"""`benchmarks.spec_report`: the speculation comparison's table, ratios and goals."""

from __future__ import annotations

import math

from benchmarks.serve_report import Measurement
from benchmarks.spec_report import (
    ANCHOR,
    COPY,
    OURS_OFF,
    OURS_ON,
    TPOT_NOTE,
    VLLM_ON,
    SpecRow,
    format_failures,
    format_goals,
    format_ratios,
    format_table,
)
from cluster.bench.speculation import SpecTotals


def _m(tok_s: float, itl: float, tpot: float, ttft: float = 300.0) -> Measurement:
    return Measurement(
        tok_s,
        ttft,
        2 * ttft,
        itl,
        2 * itl,
        32,
        0,
        duration_s=60.0,
        tpot_p50=tpot,
        tpot_p99=2 * tpot,
    )


def _row(
    server: str,
    workload: str,
    m: Measurement | None,
    spec: SpecTotals | None = None,
    error: str = "",
) -> SpecRow:
    return SpecRow("agg", server, f"{server} label", workload, "1", m, spec, error)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip("|").split("|")]


def test_table_has_both_latencies_and_the_speculation_figures() -> None:
    spec = SpecTotals(drafted=300, accepted=225, verifies=100)
    rows = [
        _row(OURS_ON, COPY, _m(120.0, 40.0, 15.0), spec=spec),
        _row(OURS_OFF, COPY, _m(100.0, 30.0, 30.0)),
        _row(VLLM_ON, COPY, None, error="vllm exited"),
    ]
    table = format_table(rows).splitlines()
    assert "ITL p50 / p99 ms (per chunk)" in table[0]
    assert "TPOT p50 / p99 ms (per token)" in table[0]
    assert table[1] == "|" + "---|" * 10
    assert table[2] == (
        "| agg | ours-on | copy | 1 | 40.0 / 80.0 | 15.0 / 30.0 | 300 / 600 | 120.0 | 75.0% | 3.25 |"
    )
    assert table[3].endswith("| 100.0 | - | - |")  # no speculation metrics
    idle = format_table([_row(VLLM_ON, ANCHOR, _m(90.0, 30.0, 30.0), SpecTotals())])
    assert idle.splitlines()[2].endswith("| no drafts | - |")
    assert table[4] == "| agg | vllm-ngram | copy | 1 | failed: vllm exited | | | | | |"
    assert format_failures(rows) == "  agg vllm-ngram failed: vllm exited"
    assert format_failures(rows[:2]) == ""


def test_ratios_of_ours_on_over_off_and_over_vllm() -> None:
    rows = [
        _row(OURS_ON, COPY, _m(120.0, 40.0, 15.0, ttft=330.0)),
        _row(OURS_OFF, COPY, _m(100.0, 30.0, 30.0)),
        _row(VLLM_ON, COPY, _m(150.0, 50.0, 20.0)),
        _row(OURS_ON, ANCHOR, _m(96.0, 30.0, 30.0)),
        _row(OURS_OFF, ANCHOR, _m(100.0, 30.0, 30.0)),
    ]
    lines = format_ratios(rows).splitlines()
    assert "TPOT p50 (per token)" in lines[0] and "ITL p50 (per chunk)" in lines[0]
    assert [_cells(line) for line in lines[2:]] == [
        ["agg", "copy", "1", "ours-on / ours-off", "0.50x", "1.33x", "1.10x", "1.20x"],
        ["agg", "copy", "1", "ours-on / vllm-ngram", "0.75x", "0.80x", "1.10x", "0.80x"],
        ["agg", "anchor", "1", "ours-on / ours-off", "1.00x", "1.00x", "1.00x", "0.96x"],
    ]  # no vLLM row on the anchor: it did not run


def test_decode_latency_goals_are_read_on_tpot_not_on_chunk_itl() -> None:
    rows = [
        # Per chunk slower (a verify step), per token twice as fast.
        _row(OURS_ON, COPY, _m(120.0, 40.0, 15.0)),
        _row(OURS_OFF, COPY, _m(100.0, 30.0, 30.0)),
        _row(VLLM_ON, COPY, _m(110.0, 10.0, 12.0)),
        _row(OURS_ON, ANCHOR, _m(96.0, 30.0, 30.0)),
        _row(OURS_OFF, ANCHOR, _m(100.0, 30.0, 30.0)),
    ]
    table, note = format_goals(rows).split("\n\n")
    header, _rule, line = table.splitlines()
    assert _cells(header)[2:] == [
        "copy: on / ours-off TPOT p50 (goal <= 0.7)",
        "copy: on / vllm-ngram TPOT p50 (goal <= 1.0)",
        "anchor: on / ours-off out tok/s (goal >= 0.95)",
    ]
    assert _cells(line) == ["agg", "1", "0.50x (meets)", "1.25x (misses)", "0.96x (meets)"]
    assert note == TPOT_NOTE and "TPOT" in note and "per streamed chunk" in note


def test_goals_without_a_counterpart_or_over_a_zero_latency() -> None:
    rows = [
        _row(OURS_ON, COPY, _m(120.0, 0.0, 15.0)),
        _row(OURS_OFF, COPY, _m(100.0, 0.0, math.nan)),
    ]
    cells = _cells(format_goals(rows).splitlines()[2])
    assert cells[2:] == ["-"] * 3
    assert _cells(format_ratios(rows).splitlines()[2])[4:] == ["-", "-", "1.00x", "1.20x"]
