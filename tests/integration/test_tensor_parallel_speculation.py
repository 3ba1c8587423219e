"""Speculative decoding across heterogeneous tensor parallelism: a one-rank
context instance and a two-rank generation instance (TP 2 on CPU, gloo)
serving the tiny Nemotron-H with n-gram drafts.

Each verify's Mamba scratch slots travel to the second rank in the step's
shape, and both ranks swap the accepted lane's state in: the answers equal
transformers' greedy tokens, and /metrics shows the verifies ran.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.greedy_reference import full_forward_greedy
from tests.integration.test_serve_openai import Server
from tests.integration.test_serve_speculation import NGRAM, spec_totals
from tests.integration.test_tensor_parallel_serve import serving

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.embedded.writer import ensure_checkpoint

    return ensure_checkpoint(tmp_path_factory.mktemp("ckpt") / "nemotron_h", "nemotron_h", "tiny")


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    sections = {
        "conditional_disagg": {"max_local_prefill_length": 0},
        "context_servers": {"num_instances": 1},
        "generation_servers": {"num_instances": 1, "tensor_parallel_size": 2},
        "speculative_config": NGRAM,
    }
    with serving(checkpoint, sections, tmp_path_factory.mktemp("config")) as running:
        yield running


def test_drafts_verified_on_two_generation_ranks_keep_transformers_tokens(
    server: Server, checkpoint: Path
) -> None:
    plan = [line for line in server.output if line.startswith("generation-0")]
    assert plan and "cpu x2" in plan[0]
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    rng = random.Random(5)
    for n in range(3):
        passage = [rng.randrange(10, 400) for _ in range(24 + 4 * n)]
        prompt = passage + passage[:5]
        want, _ = full_forward_greedy(model, prompt, NEW_TOKENS)
        reply = client.completions.create(
            model=server.model,
            prompt=prompt,
            max_tokens=NEW_TOKENS,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )
        served = reply.choices[0].logprobs
        assert served is not None
        assert served.tokens == [f"token_id:{t}" for t in want], n
    deadline = time.monotonic() + 30
    totals = spec_totals(server.url)
    while totals.get("verifies", 0) == 0 and time.monotonic() < deadline:
        time.sleep(1.5)
        totals = spec_totals(server.url)
    assert totals.get("drafted", 0) > 0, totals
