"""Speculative decoding across heterogeneous tensor parallelism: a one-rank
context instance and a two-rank generation instance (TP 2 on CPU, gloo)
serving the tiny Nemotron-H with n-gram drafts.

Each verify's Mamba scratch slots travel to the second rank in the step's
shape, and both ranks swap the accepted lane's state in: the answers equal
transformers' greedy tokens, and /metrics shows the verifies ran.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_serve_openai import Server
from tests.integration.test_serve_speculation import (
    NGRAM,
    assert_copy_prompts_keep_transformers_greedy,
)
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
    totals = assert_copy_prompts_keep_transformers_greedy(
        server.url, server.model, checkpoint, seed=5, stream=False
    )
    assert totals.drafted > 0, totals
