"""benchmarks.transfer rows: the ratio is a median over rounds with its spread, CPU cost per byte."""

from __future__ import annotations

import json

import pytest

from benchmarks.transfer.throughput import (
    BENCH_SPEC,
    BLOCK_BYTES,
    MIB,
    SIZES,
    Rounds,
    _format,
    _row,
    head_slice_run,
    rank_specs,
)
from kvcache.pool_layout import layout_for


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


def test_a_row_with_the_split_read_reports_the_descriptor_floor() -> None:
    rounds = Rounds()
    # (own, raw, raw cut into head-slice descriptors) per round.
    for own, raw, cut in [(0.20, 0.10, 0.125), (0.40, 0.10, 0.20), (0.25, 0.10, 0.125)]:
        rounds.add(own, 0.1, raw, 0.1, cut)
    row = _row("nixl", "v2", 64 * MIB, rounds, [0.01], [0.0, 0.0], (2, 1), 128 * 1024)

    # Per round raw/cut: 0.8, 0.5, 0.8; cut/own: 0.625, 0.5, 0.5.
    assert (row.floor, row.ratio_to_floor, row.split_run_bytes) == (0.8, 0.5, 128 * 1024)
    assert row.split_raw_p50_ms == 125.0
    assert json.loads(json.dumps(row.as_json()))["floor"] == 0.8
    assert _format(row).endswith("floor 0.80")
    # Rows without the split READ leave the fields empty.
    plain = _row("nixl", "v2", 64 * MIB, _rounds(), [0.01], [0.0, 0.0])
    assert (plain.floor, plain.ratio_to_floor, plain.split_run_bytes) == (None, None, None)
    assert "floor" not in _format(plain)


@pytest.mark.parametrize("ranks", [(2, 1), (1, 2)])
def test_a_head_slice_run_is_half_a_block_in_v2_and_half_a_layer_block_in_v1(
    ranks: tuple[int, int],
) -> None:
    block = BLOCK_BYTES  # every layer's KV of one block, all heads
    assert head_slice_run("v2", ranks) == block // 2
    assert head_slice_run("v1", ranks) == block // 2 // BENCH_SPEC.num_attention_layers


def test_the_default_tensor_parallel_rows_are_rank_pairs_as_parsed_ones_are() -> None:
    """argparse applies `type` to a string default only: the default rows
    must already be (holder, puller) pairs."""
    import argparse

    from benchmarks.transfer.throughput import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).tensor_parallel == [(1, 1), (2, 1), (1, 2)]
    assert parser.parse_args(["--tensor-parallel", "2:1"]).tensor_parallel == [(2, 1)]
