"""`disagg serve` with a tensor-parallel context instance (TP 2 on CPU, gloo)
and a one-rank generation instance: the 2 -> 1 case disaggregation exists for.

Every request prefills on the two context ranks, and the generation instance
pulls each rank's KV heads (the tiny Llama has 2 KV heads: one per context
rank) through the Python transceiver, which `auto` picks for a tensor-parallel
cluster. Greedy text through the OpenAI API must equal transformers'.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.integration.test_serve_openai import Server, _greedy
from tests.integration.test_tensor_parallel_serve import MAX_TOKENS, PROMPTS
from tests.serve_process import start_serve, stop_group


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.embedded.writer import ensure_checkpoint

    return ensure_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", "llama", "tiny")


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = {
        "model": str(checkpoint),
        "kv_cache": {"max_tokens": 512},
        "max_batch_size": 4,
        "context_servers": {"num_instances": 1, "tensor_parallel_size": 2},
        "generation_servers": {"num_instances": 1},
    }
    path = tmp_path_factory.mktemp("config") / "ctx-tp2.yaml"
    path.write_text(yaml.safe_dump(config))
    running = start_serve(path, checkpoint)
    try:
        yield Server(running.process, running.url, checkpoint.name, running.output)
    finally:
        stop_group(running.process)


def test_the_plan_shows_two_context_ranks_and_the_python_transceiver(server: Server) -> None:
    plan = [line for line in server.output if line.startswith("context-0")]
    assert plan and "cpu x2" in plan[0] and "python" in plan[0]


def test_greedy_text_through_two_context_ranks_matches_transformers(
    server: Server, checkpoint: Path
) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    for prompt in PROMPTS:
        expected = _greedy((model, tokenizer), tokenizer(prompt).input_ids, MAX_TOKENS)
        whole = client.completions.create(
            model=server.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert whole.choices[0].text == expected
