"""`disagg bench`'s speculative decoding figures: read from ours and from
vLLM's `/metrics`, differenced over a run, and the two rates."""

from __future__ import annotations

import pytest

from cluster.bench.speculation import (
    SpecTotals,
    format_speculation,
    parse_spec_totals,
    run_totals,
)
from cluster.metrics import ServingMetrics
from engine.messages import WorkerLoad

# vLLM's CPU build with n-gram speculation, one engine (counters, `_total` samples).
VLLM_EXPOSITION = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 40.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 120.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 90.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 35.0
"""


def _load(worker: str, drafted: int, accepted: int, verifies: int) -> WorkerLoad:
    return WorkerLoad(
        worker_id=worker,
        role="generation",
        num_waiting=0,
        num_running=0,
        num_transferring=0,
        num_free_blocks=10,
        num_total_blocks=10,
        num_free_mamba_slots=0,
        num_tokens_in_flight=0,
        spec_verifies=verifies,
        spec_drafted=drafted,
        spec_accepted=accepted,
        spec_drafted_at=(verifies, verifies, verifies),
        spec_accepted_at=(accepted, 0, 0),
    )


def test_ours_summed_over_every_worker() -> None:
    metrics = ServingMetrics()
    metrics.record_speculation("generation-0", _load("generation-0", 30, 12, 10))
    metrics.record_speculation("generation-1", _load("generation-1", 60, 45, 20))
    totals = parse_spec_totals(metrics.exposition().decode())
    assert totals == SpecTotals(drafted=90, accepted=57, verifies=30)


def test_vllm_counters_read_by_the_same_kinds() -> None:
    assert parse_spec_totals(VLLM_EXPOSITION) == SpecTotals(drafted=120, accepted=90, verifies=40)


def test_a_server_without_speculation_has_none() -> None:
    # Our router lists the metric only once a worker reported drafting.
    assert parse_spec_totals(ServingMetrics().exposition().decode()) is None
    assert parse_spec_totals("# TYPE other gauge\nother 3.0\n") is None


def test_run_is_after_minus_before_and_its_two_rates() -> None:
    before = SpecTotals(drafted=30, accepted=12, verifies=10)
    after = SpecTotals(drafted=90, accepted=57, verifies=30)
    run = run_totals(before, after)
    assert run == SpecTotals(drafted=60, accepted=45, verifies=20)
    assert run is not None
    assert run.acceptance_rate == pytest.approx(0.75)
    # 20 verifies yielded 45 accepted drafts and 20 bonus tokens.
    assert run.mean_accepted_length == pytest.approx(65 / 20)
    assert "acceptance 75.0% (45/60 drafts), 3.25 tokens per verify (20 verifies)" in (
        format_speculation(run)
    )


def test_bounds_of_the_mean_accepted_length() -> None:
    none_accepted = SpecTotals(drafted=30, accepted=0, verifies=10)
    all_accepted = SpecTotals(drafted=30, accepted=30, verifies=10)
    assert none_accepted.mean_accepted_length == 1.0
    assert all_accepted.mean_accepted_length == 4.0  # 3 drafts + the bonus token
    assert all_accepted.acceptance_rate == 1.0


def test_missing_reads_and_an_idle_run() -> None:
    after = SpecTotals(drafted=9, accepted=3, verifies=3)
    assert run_totals(None, after) == after  # metrics listed from the first poll on
    assert run_totals(after, None) is None
    idle = run_totals(after, after)
    assert idle is not None and idle.acceptance_rate is None and idle.mean_accepted_length is None
    assert "no drafts verified" in format_speculation(idle)
    assert idle.as_dict()["acceptance_rate"] is None
