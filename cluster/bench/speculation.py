"""Speculative decoding over one benchmark run, from the server's `/metrics`.

Two servers' metric names are read, each summed over every worker or engine
that reports them:

| quantity | ours (gauges, totals since start) | vLLM (counters) |
| --- | --- | --- |
| draft tokens verified | `disagg_spec_tokens{kind="drafted"}` | `vllm:spec_decode_num_draft_tokens_total` |
| drafts accepted | `disagg_spec_tokens{kind="accepted"}` | `vllm:spec_decode_num_accepted_tokens_total` |
| verifies (one request's drafts in one step) | `disagg_spec_tokens{kind="verifies"}` | `vllm:spec_decode_num_drafts_total` |

A run's figures are the difference of a read after it and one before:

    acceptance rate      = accepted / drafted
    mean accepted length = (accepted + verifies) / verifies

the second being the tokens a verify step yields, the bonus (or corrected)
token sampled after the last accepted draft included: 1.0 when no draft is
ever accepted, `num_speculative_tokens + 1` when every draft is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

OURS = "disagg_spec_tokens"
# Ours are gauges the router sets from each worker's load report, polled every
# 0.25 s: a read right after a run can miss its last steps, a second one later not.
SETTLE_S = 1.0
# vLLM's counter samples, by our `kind` label.
VLLM_SAMPLES = {
    "drafted": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
    "verifies": "vllm:spec_decode_num_drafts_total",
}


@dataclass(frozen=True)
class SpecTotals:
    """Speculative decoding counts, summed over a server's workers."""

    drafted: int = 0
    accepted: int = 0
    verifies: int = 0

    def __sub__(self, earlier: SpecTotals) -> SpecTotals:
        return SpecTotals(
            self.drafted - earlier.drafted,
            self.accepted - earlier.accepted,
            self.verifies - earlier.verifies,
        )

    def __add__(self, other: SpecTotals) -> SpecTotals:
        return SpecTotals(
            self.drafted + other.drafted,
            self.accepted + other.accepted,
            self.verifies + other.verifies,
        )

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted; None when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per verify step, the bonus token included; None with no verify."""
        return (self.accepted + self.verifies) / self.verifies if self.verifies else None

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "verifies": self.verifies,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }


def parse_spec_totals(exposition: str) -> SpecTotals | None:
    """The totals a Prometheus text exposition holds, ours or vLLM's; None
    when it has neither (a server without speculation, or another server)."""
    counts = {"drafted": 0.0, "accepted": 0.0, "verifies": 0.0}
    vllm_kinds = {name: kind for kind, name in VLLM_SAMPLES.items()}
    found = False
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == OURS:
                kind = sample.labels.get("kind", "")
            elif sample.name in vllm_kinds:
                kind = vllm_kinds[sample.name]
            else:
                continue
            if kind in counts:
                counts[kind] += sample.value
                found = True
    if not found:
        return None
    return SpecTotals(
        round(counts["drafted"]), round(counts["accepted"]), round(counts["verifies"])
    )


def read_spec_totals(root_url: str, timeout_s: float = 10.0) -> SpecTotals | None:
    """`parse_spec_totals` of `root_url`/metrics; None when it has no such
    metrics or cannot be read (no `/metrics`, not Prometheus text)."""
    try:
        response = httpx.get(root_url.rstrip("/") + "/metrics", timeout=timeout_s)
        if response.status_code != 200:
            return None
        return parse_spec_totals(response.text)
    except (httpx.HTTPError, ValueError):
        return None


def read_settled(root_url: str) -> SpecTotals | None:
    """`read_spec_totals` for the end of a run: where the server has the
    metrics, read once more `SETTLE_S` later, after its last steps were polled."""
    if read_spec_totals(root_url) is None:
        return None
    time.sleep(SETTLE_S)
    return read_spec_totals(root_url)


def run_totals(before: SpecTotals | None, after: SpecTotals | None) -> SpecTotals | None:
    """What a run added between two reads. A server that had none of the
    metrics before (ours reports them from a worker's first poll on) counts
    from zero; None when it has none after."""
    if after is None:
        return None
    return after - (before or SpecTotals())


def format_speculation(run: SpecTotals) -> str:
    """One line for the run's summary."""
    rate, length = run.acceptance_rate, run.mean_accepted_length
    if rate is None or length is None:
        return f"speculation     no drafts verified in this run ({run.verifies} verifies)"
    return (
        f"speculation     acceptance {rate:.1%} ({run.accepted}/{run.drafted} drafts), "
        f"{length:.2f} tokens per verify ({run.verifies} verifies)"
    )
