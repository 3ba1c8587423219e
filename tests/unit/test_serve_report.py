"""`benchmarks.serve_report`: the served comparison's tables and ratios."""

from __future__ import annotations

from benchmarks.serve_report import Measurement, Row, format_cpu, format_ratios, format_table
from benchmarks.serve_targets import OFFLINE


def _m(tok_s: float, ttft: float, itl: float) -> Measurement:
    return Measurement(tok_s, ttft, 2 * ttft, itl, 3 * itl, completed=64, failed=0)


def test_table_rows_and_a_failed_server() -> None:
    rows = [
        Row("vllm-agg", "vLLM agg", "inf", False, _m(1000.0, 500.0, 20.0)),
        Row("ours-agg", "ours agg", "inf", True, None, "exited 1"),
    ]
    table = format_table(rows).splitlines()
    assert table[0].startswith("| server | prefix cache | rate | out tok/s")
    assert table[2] == "| vLLM agg | off | inf | 1000 | 500 / 1000 | 20.0 / 60.0 |"
    assert table[3].startswith("| ours agg | on | inf | failed: exited 1")


def test_ratios_pair_ours_with_vllm_per_rate() -> None:
    rows = [
        Row("vllm-1p1d", "v", "8", False, _m(400.0, 200.0, 10.0)),
        Row("ours-1p1d-python", "p", "8", False, _m(440.0, 100.0, 20.0)),
        Row("ours-1p1d-nixl", "n", "8", False, None, "failed"),
    ]
    lines = format_ratios(rows).splitlines()
    assert len(lines) == 3  # header, rule, one pair (nixl failed; no aggregated rows)
    assert (
        lines[2] == "| ours-1p1d-python / vllm-1p1d | 8 | 1.10x | 0.50x / 0.50x | 2.00x / 2.00x |"
    )


def test_no_ratio_over_a_zero_latency() -> None:
    rows = [
        Row("vllm-agg", "v", "2", False, _m(126.0, 50.0, 0.0)),
        Row("ours-agg", "o", "2", False, _m(127.0, 60.0, 3.0)),
    ]
    expected = "| ours-agg / vllm-agg | 2 | 1.01x | 1.20x / 1.20x | - / - |"
    assert format_ratios(rows).splitlines()[2] == expected


def test_offline_row_has_tok_s_only_and_a_served_over_offline_ratio() -> None:
    nan = float("nan")
    rows = [
        Row("ours-agg", "served", "inf", False, _m(900.0, 400.0, 20.0)),
        Row(OFFLINE, "offline", "inf", False, Measurement(1000.0, nan, nan, nan, nan, 64, 0)),
    ]
    assert format_table(rows).splitlines()[3] == "| offline | off | inf | 1000 | - / - | - / - |"
    assert (
        format_ratios(rows).splitlines()[-1] == f"| ours-agg served / {OFFLINE} | inf | 0.90x | | |"
    )


def test_server_cpu_line_names_the_largest_and_sums_the_rest() -> None:
    spent = {
        "ray::GenerationW": 2.47,
        "python": 0.63,
        "raylet": 0.09,
        "gcs_server": 0.06,
        "x": 0.02,
    }
    assert format_cpu(spent) == (
        "server 3.27 (ray::GenerationW 2.47, python 0.63, raylet 0.09, 2 more 0.08)"
    )
