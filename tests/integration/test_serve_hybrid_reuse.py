"""Block reuse on a Nemotron-H hybrid, served: aggregated and 1P1D over each
transceiver, through the OpenAI API.

Two four-turn conversations share a system prompt; each turn's prompt is the
last turn's prompt and answer plus a new user part, in token ids. Every
answer equals transformers' greedy continuation (logprobs within 1e-4), each token from a full
forward of the sequence so far (transformers' cached one-token path clamps
the Mamba time step differently, see `models/layers/mamba2.py`, and on a
tiny random model that alone flips near ties), and from the second turn on
`cached_tokens` shows the tokens that were skipped: aggregated, everything
up to the last answer's final token (the end-of-sequence snapshot); 1P1D,
the context worker resumes after the last turn's prompt (its own snapshot
at the end of the prompt it prefilled).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.greedy_reference import full_forward_greedy
from tests.serve_process import ServeProcess, start_serve, stop_group
from transfer.nixl.agent import nixl_available

NEW_TOKENS = 8
TURNS = 4
LOGPROB_TOLERANCE = 1e-4

MODES = {
    "aggregated": {"context_servers": {"num_instances": 0}},
    "1p1d-python": {"cache_transceiver": {"backend": "python"}},
    "1p1d-nixl": {"cache_transceiver": {"backend": "nixl"}},
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.embedded.writer import ensure_checkpoint

    return ensure_checkpoint(tmp_path_factory.mktemp("hybrid") / "nemotron_h", "nemotron_h", "tiny")


@pytest.fixture(scope="module", params=list(MODES))
def server(
    request: pytest.FixtureRequest, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, ServeProcess]]:
    mode = request.param
    if mode == "1p1d-nixl" and not nixl_available():
        pytest.fail("the nixl package is part of the project's install; it must import")
    config = {
        "model": str(checkpoint),
        "router": {"type": "prefix_aware"},
        "conditional_disagg": {"max_local_prefill_length": 0},
        "kv_cache": {"manager": "v2", "enable_block_reuse": True, "max_tokens": 2048},
        "max_num_tokens": 32,  # prompts prefill in several chunks
        "max_batch_size": 4,
        "context_servers": {"num_instances": 1},
        "generation_servers": {"num_instances": 1},
    }
    for key, value in MODES[mode].items():
        config[key] = {**config.get(key, {}), **value}
    path = tmp_path_factory.mktemp(mode) / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    running = start_serve(path, checkpoint)
    try:
        yield mode, running
    finally:
        stop_group(running.process)


def test_each_turn_equals_transformers_and_resumes_where_the_last_left_off(
    server: tuple[str, ServeProcess], checkpoint: Path
) -> None:
    mode, running = server
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    rng = random.Random(7)
    system = [rng.randrange(10, 500) for _ in range(40)]
    conversations = [system + [rng.randrange(10, 500) for _ in range(6 + c)] for c in range(2)]
    client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=120)
    for turn in range(TURNS):
        references = [full_forward_greedy(model, p, NEW_TOKENS) for p in conversations]
        expected = [tokens for tokens, _ in references]
        for c, prompt in enumerate(conversations):
            reply = client.completions.create(
                model=checkpoint.name,
                prompt=prompt,
                max_tokens=NEW_TOKENS,
                temperature=0,
                logprobs=0,
                extra_body={"ignore_eos": True},  # transformers' greedy runs NEW_TOKENS
            )
            want = tokenizer.decode(expected[c], skip_special_tokens=True)
            assert reply.choices[0].text == want, (mode, turn, c)
            served = reply.choices[0].logprobs
            assert served is not None and served.token_logprobs is not None
            gaps = [
                abs(a - b) for a, b in zip(served.token_logprobs, references[c][1], strict=True)
            ]
            assert max(gaps) < LOGPROB_TOLERANCE, (mode, turn, c, gaps)
            details = reply.usage.prompt_tokens_details
            cached = 0 if details is None else details.cached_tokens or 0
            if turn > 0:
                previous = len(prompt) - NEW_TOKENS - 5  # last turn's prompt
                resumed = previous + NEW_TOKENS - 1 if mode == "aggregated" else previous
                assert cached == resumed, (mode, turn, c, cached, len(prompt))
        conversations = [
            p + out + [rng.randrange(10, 500) for _ in range(5)]
            for p, out in zip(conversations, expected, strict=True)
        ]
