"""MTP drafting on tensor-parallel instances: a two-rank context instance
and a two-rank generation instance (TP 2 on CPU, gloo) serving a tiny
Nemotron-H with one MTP step, its weights rewired (`tests.mtp_bigram`) so
that the MTP's drafts are mostly right.

Every rank runs its shard of the MTP layers on rank 0's kept tokens, so
the context instance's first drafts and the generation instance's verify
drafts come from the sharded MTP: the answers equal transformers' greedy
tokens (speculation never changes them), and /metrics shows drafts
accepted, which sharded MTP layers loaded or run wrong would not give.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_serve_openai import Server
from tests.integration.test_serve_speculation import assert_copy_prompts_keep_transformers_greedy
from tests.integration.test_tensor_parallel_serve import serving
from tests.mtp_bigram import bigram_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.embedded.writer import ensure_checkpoint

    root = tmp_path_factory.mktemp("tp-mtp")
    source = ensure_checkpoint(root / "source", "nemotron_h", "tiny", mtp=True)
    return bigram_checkpoint(source, root / "nemotron_h_mtp")


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    sections = {
        "conditional_disagg": {"max_local_prefill_length": 0},
        "context_servers": {"num_instances": 1, "tensor_parallel_size": 2},
        "generation_servers": {"num_instances": 1, "tensor_parallel_size": 2},
        "speculative_config": {"method": "mtp", "num_speculative_tokens": 3},
    }
    with serving(checkpoint, sections, tmp_path_factory.mktemp("config")) as running:
        yield running


def test_mtp_drafts_on_two_ranks_keep_transformers_tokens_and_are_accepted(
    server: Server, checkpoint: Path
) -> None:
    plans = [line for line in server.output if line.startswith(("context-0 ", "generation-0 "))]
    assert sum("cpu x2" in line for line in plans) == 2, plans
    totals = assert_copy_prompts_keep_transformers_greedy(
        server.url, server.model, checkpoint, seed=7, stream=False
    )
    assert totals.drafted > 0, totals
    assert totals.accepted > 0.2 * totals.drafted, totals
