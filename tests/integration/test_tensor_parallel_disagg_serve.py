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

import pytest

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
