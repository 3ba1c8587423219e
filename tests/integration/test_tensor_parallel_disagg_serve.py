"""`disagg serve` with a tensor-parallel context instance (TP 2 on CPU, gloo)
and a one-rank generation instance: the 2 -> 1 case disaggregation exists for.

Every request prefills on the two context ranks, and the generation instance
pulls each rank's KV heads (the tiny Llama has 2 KV heads: one per context
rank) through the Python transceiver, which `auto` picks for a tensor-parallel
cluster. Greedy text through the OpenAI API must equal transformers';
`/metrics` counts the bytes of both context ranks' handles, and starting the
ranks blocks no worker's event loop (Ray warns when a `ray.get` could).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from models.hf_config import load_model_config
from tests.integration.test_serve_openai import Server
from tests.integration.test_tensor_parallel_serve import (
    assert_greedy_text_matches_transformers,
    serving,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.embedded.writer import ensure_checkpoint

    return ensure_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", "llama", "tiny")


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    sections = {
        "context_servers": {"num_instances": 1, "tensor_parallel_size": 2},
        "generation_servers": {"num_instances": 1},
    }
    with serving(checkpoint, sections, tmp_path_factory.mktemp("config")) as running:
        yield running


def test_the_plan_shows_two_context_ranks_and_the_python_transceiver(server: Server) -> None:
    plan = [line for line in server.output if line.startswith("context-0")]
    assert plan and "cpu x2" in plan[0] and "python" in plan[0]


def test_greedy_text_through_two_context_ranks_matches_transformers(
    server: Server, checkpoint: Path
) -> None:
    assert_greedy_text_matches_transformers(server, checkpoint)


def test_transfer_bytes_count_both_context_ranks_heads(server: Server, checkpoint: Path) -> None:
    """Each context rank holds one of the two KV heads: together, every byte
    of the prompt's blocks (the config's block size, 16 tokens)."""
    before = _transfer_bytes(server)
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    completion = client.completions.create(
        model=server.model, prompt="Count the bytes of this prompt", max_tokens=2, temperature=0
    )
    assert completion.usage is not None
    spec = load_model_config(checkpoint).cache_spec()
    blocks = -(-completion.usage.prompt_tokens // 16)
    whole = blocks * spec.num_attention_layers * spec.kv_bytes_per_block_per_layer(16)
    after = _transfer_bytes(server)
    assert after - before == whole


def test_starting_the_ranks_blocked_no_event_loop(server: Server) -> None:
    """Ray forwards a worker's warnings to serve's output, among them its
    warning about a blocking `ray.get` inside an async actor (which rank 0
    of a tensor-parallel instance once logged while its ranks started)."""
    assert not [line for line in server.output if "blocking ray.get" in line]


def _transfer_bytes(server: Server) -> float:
    text = httpx.get(server.url.removesuffix("/v1") + "/metrics", timeout=30).text
    found = re.search(r"^disagg_kv_transfer_bytes_total (\S+)$", text, re.MULTILINE)
    assert found, "no disagg_kv_transfer_bytes_total in /metrics"
    return float(found.group(1))
