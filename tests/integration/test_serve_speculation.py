"""Speculative decoding served: n-gram drafts on a Llama (aggregated and
1P1D over each transceiver) and on a Nemotron-H hybrid (1P1D over NIXL), and
the Nemotron-H checkpoint's own MTP layers (one MTP step, `*E`; aggregated,
and in 1P1D, where the context worker sends the first drafts with the first
token, also with hybrid block reuse and under conditional disaggregation),
through the OpenAI API.

Prompts repeat a passage and ask for more of it; every answer equals
transformers' greedy continuation of the same token ids (each token from a
full forward of the sequence so far) with logprobs within 1e-4, streamed
answers equal whole ones, and /metrics shows the drafts the generation side
verified (on the Llama, accepted ones too).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cluster.bench.speculation import SpecTotals, read_spec_totals
from tests.greedy_reference import full_forward_greedy
from tests.serve_process import ServeProcess, start_mode, stop_group
from transfer.nixl.agent import nixl_available

NEW_TOKENS = 16
LOGPROB_TOLERANCE = 1e-4

MODES = {
    "aggregated": {"context_servers": {"num_instances": 0}},
    "1p1d-python": {"cache_transceiver": {"backend": "python"}},
    "1p1d-nixl": {"cache_transceiver": {"backend": "nixl"}},
}
MTP_MODES = {
    **MODES,
    # Prompts up to 32 tokens prefill on the generation worker, longer ones
    # on the context worker: both paths in one server.
    "1p1d-conditional": {"conditional_disagg": {"max_local_prefill_length": 32}},
    "1p1d-python-reuse": {
        "cache_transceiver": {"backend": "python"},
        "kv_cache": {
            "enable_block_reuse": True,
            "snapshots": {"at_end": True, "on_demand": True, "num_slots": 16},
        },
    },
}
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
MTP = {"method": "mtp", "num_speculative_tokens": 3}
# n-gram drafts on the Llama in every mode; on the hybrid over NIXL (its
# Mamba rollback on rejected drafts runs aggregated and over the Python
# transceiver in the MTP cases); MTP in every mode but NIXL (drafts ride on
# the context result, not the transceiver, and NIXL is the n-gram hybrid's).
CASES = [
    *(("llama", mode) for mode in MODES),
    ("nemotron_h", "1p1d-nixl"),
    *(("nemotron_h_mtp", mode) for mode in MTP_MODES if mode != "1p1d-nixl"),
]


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{m}" for a, m in CASES])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path, ServeProcess]]:
    from models.embedded.writer import ensure_checkpoint

    arch, mode = request.param
    if mode == "1p1d-nixl" and not nixl_available():
        pytest.fail("the nixl package is part of the project's install; it must import")
    mtp = arch == "nemotron_h_mtp"
    checkpoint = ensure_checkpoint(
        tmp_path_factory.getbasetemp() / f"spec-{arch}",
        "nemotron_h" if mtp else arch,
        "tiny",
        mtp=mtp,
    )
    overrides = {
        "max_batch_size": 4,
        "speculative_config": MTP if mtp else NGRAM,
        **MTP_MODES[mode],
    }
    running = start_mode(tmp_path_factory.mktemp(f"{arch}-{mode}"), checkpoint, overrides)
    try:
        yield mode, checkpoint, running
    finally:
        stop_group(running.process)


def assert_copy_prompts_keep_transformers_greedy(
    url: str, model_name: str, checkpoint: Path, seed: int, stream: bool = True
) -> SpecTotals:
    """Three prompts that repeat a passage (what the n-gram drafter finds):
    each served greedy answer (and, with `stream`, its streamed text) must
    be transformers' full-forward greedy tokens with their logprobs. Returns
    the speculation totals once the router's polled report settles."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    rng = random.Random(seed)
    for n in range(3):
        passage = [rng.randrange(10, 400) for _ in range(24 + 4 * n)]
        prompt = passage + passage[:5]
        want, want_logprobs = full_forward_greedy(model, prompt, NEW_TOKENS)
        reply = client.completions.create(
            model=model_name,
            prompt=prompt,
            max_tokens=NEW_TOKENS,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )
        text = tokenizer.decode(want, skip_special_tokens=True)
        choice = reply.choices[0]
        served = choice.logprobs
        assert served is not None and served.token_logprobs is not None
        assert served.tokens == [f"token_id:{t}" for t in want], (url, n)
        assert choice.text == text
        gaps = [abs(a - b) for a, b in zip(served.token_logprobs, want_logprobs, strict=True)]
        assert max(gaps) < LOGPROB_TOLERANCE, (url, n, gaps)
        if stream:
            chunks = client.completions.create(
                model=model_name,
                prompt=prompt,
                max_tokens=NEW_TOKENS,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    # The router reports what it last polled from the workers: wait for the
    # report of the requests above (their totals stop growing).
    root = url.removesuffix("/v1")
    totals, deadline = read_spec_totals(root) or SpecTotals(), time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(1.5)
        latest = read_spec_totals(root) or SpecTotals()
        if latest == totals and totals.verifies > 0:
            break
        totals = latest
    return totals


def test_answers_equal_transformers_with_drafts_verified(
    server: tuple[str, Path, ServeProcess],
) -> None:
    mode, checkpoint, running = server
    totals = assert_copy_prompts_keep_transformers_greedy(
        running.url, checkpoint.name, checkpoint, seed=3
    )
    assert totals.drafted > 0, (mode, totals)
    if checkpoint.name.endswith("llama"):
        assert totals.accepted > 0, totals
