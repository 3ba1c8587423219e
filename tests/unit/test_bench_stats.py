"""`disagg bench`'s summary table: token counts, and goodput only where an SLO was given."""

from __future__ import annotations

import pytest

from cluster.bench.stats import SLO, RequestRecord, format_summary, percentile, summarize


def _records() -> list[RequestRecord]:
    def record(prompt: int, output: int) -> RequestRecord:
        times = [0.1 * (i + 1) for i in range(output)]
        return RequestRecord(0.0, prompt, output, times, [1] * output)

    return [record(100, 4), record(60, 2), RequestRecord(0.0, 999, 0, error="HTTP 500")]


def test_prompt_and_output_tokens_of_the_completed_requests() -> None:
    summary = summarize(_records(), 1.0, SLO())
    assert summary["prompt_tokens"] == {"total": 160, "mean": pytest.approx(80.0)}
    assert summary["output_tokens"] == {"total": 6, "mean": pytest.approx(3.0)}
    assert "prompt 160 (80.0 mean), output 6 (3.0 mean)" in format_summary(summary)


def test_goodput_is_shown_only_when_an_slo_was_given() -> None:
    assert "goodput" not in format_summary(summarize(_records(), 1.0, SLO()))
    table = format_summary(summarize(_records(), 1.0, SLO(ttft_s=0.05)))
    assert "goodput         0.00 req/s within the SLOs" in table
    table = format_summary(summarize(_records(), 1.0, SLO(e2e_s=1.0)))
    assert "goodput         2.00 req/s within the SLOs" in table


def test_percentiles_tpot_and_goodput() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    fast = RequestRecord(
        sent=0.0, output_tokens=3, chunk_times=[0.1, 0.2, 0.3], chunk_tokens=[1, 1, 1]
    )
    slow = RequestRecord(
        sent=0.0, output_tokens=3, chunk_times=[2.0, 2.5, 3.0], chunk_tokens=[1, 1, 1]
    )
    failed = RequestRecord(sent=0.0, error="HTTP 500")
    assert fast.tpot == pytest.approx(0.1)
    summary = summarize([fast, slow, failed], duration_s=2.0, slo=SLO(ttft_s=0.5))
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert summary["goodput"] == pytest.approx(0.5)  # only `fast` meets TTFT <= 0.5 s
    assert summary["ttft"]["p50_ms"] == pytest.approx(1050.0)
    assert summary["output_token_throughput"] == pytest.approx(3.0)
