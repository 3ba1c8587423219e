"""bench-transfer's rows: the ratio is a median over rounds with its spread, and CPU cost per byte."""

from __future__ import annotations

import json

from transfer.bench import MIB, Rounds, _format, _row


def _rounds() -> Rounds:
    rounds = Rounds()
    # (transceiver s, its CPU s, raw s, raw CPU s) per round; the raw path holds steady.
    for seconds, cpu, raw_seconds, raw_cpu in [
        (0.10, 0.15, 0.10, 0.10),
        (0.20, 0.15, 0.10, 0.10),
        (0.40, 0.15, 0.10, 0.10),
        (0.125, 0.15, 0.10, 0.10),
    ]:
        rounds.add(seconds, cpu, raw_seconds, raw_cpu)
    return rounds


def test_ratio_is_the_median_of_per_round_ratios_with_min_and_max() -> None:
    row = _row("python", "v2", 256 * MIB, _rounds(), [0.01], [0.0, 0.0])

    # Per round raw/own: 1.0, 0.5, 0.25, 0.8.
    assert (row.ratio, row.ratio_min, row.ratio_max) == (0.65, 0.25, 1.0)
    out = json.loads(json.dumps(row.as_json()))
    assert (out["ratio"], out["ratio_min"], out["ratio_max"]) == (0.65, 0.25, 1.0)
    assert "0.65 (0.25-1.00)" in _format(row)


def test_cpu_cost_counts_bytes_per_cpu_second_for_both_paths() -> None:
    row = _row("python", "v2", 256 * MIB, _rounds(), [0.01], [0.0, 0.0])

    moved = 4 * 256 * MIB
    assert row.gb_per_cpu_s == round(moved / 0.6 / 1e9, 3)
    assert row.raw_gb_per_cpu_s == round(moved / 0.4 / 1e9, 3)
    assert row.cpu_cores == round(0.6 / 0.825, 2)
    assert row.raw_cpu_cores == 1.0
