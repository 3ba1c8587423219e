"""bench-transfer's rows: the ratio is a median over rounds with its spread, and CPU cost per byte."""

from __future__ import annotations

import json

import pytest

from kvcache.pool_layout import layout_for
from transfer.bench import MIB, SIZES, Rounds, _format, _row, rank_specs


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


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_rank_zero_pool_holds_the_largest_request_for_the_raw_read(
    ranks: int, manager: str
) -> None:
    """The raw limit of a tensor-parallel row is one READ of the whole
    request's bytes between the rank 0 pools, which must hold them."""
    specs = rank_specs("nixl", "tcp", manager, ranks)
    assert len(specs) == ranks
    rank0 = specs["ep"]
    layout = layout_for(manager, rank0.spec, rank0.block_size, rank0.num_blocks, 0)
    block_bytes = sum(r.length for r in layout.descriptors([1], None))
    assert rank0.spec.heads.rank == 0
    # Whole blocks from block 1 (block 0 is the null block).
    assert (rank0.num_blocks - 1) * block_bytes >= SIZES[-1]
