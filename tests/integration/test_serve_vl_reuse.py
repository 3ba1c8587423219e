"""Block reuse on the VL wrapper of a Nemotron-H hybrid, with an image, 1P1D.

A tiny Nemotron Omni checkpoint served with one context and one generation
worker, block reuse on, every request disaggregated. Turn 1 is an image and
a question; turn 2 repeats it with the answer and a follow-up. Turn 2
resumes on the context worker after turn 1's prompt (the snapshot it kept at
the end of the prompt it prefilled), and both answers equal transformers'
`NemotronH_Omni_Reasoning_V3` greedy text on the same pixels. The same chat
with another image shares no snapshot: the image's content is hashed into
its blocks, so nothing after the image is cached.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
import yaml

from benchmarks.serve_process import ServeProcess
from tests.integration.test_serve_images import (
    LONG,
    MAX_TOKENS,
    data_url,
    expected_chat_text,
    messages,
    picture,
    tiny_omni,
)

FOLLOW_UP = "And which colors?"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_omni(tmp_path_factory.mktemp("vl") / "tiny-omni", "dynamic")


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    config = {
        "model": str(checkpoint),
        "hostname": "127.0.0.1",
        "port": 0,
        "max_request_body_bytes": 4 << 20,
        "router": {"type": "prefix_aware"},
        "conditional_disagg": {"max_local_prefill_length": 0},
        "cache_transceiver": {"backend": "python"},
        "kv_cache": {"manager": "v2", "enable_block_reuse": True, "max_tokens": 1024},
        "max_num_tokens": 64,  # the prompts prefill in several chunks
        "context_servers": {"num_instances": 1, "max_batch_size": 4},
        "generation_servers": {"num_instances": 1, "max_batch_size": 4},
    }
    path = tmp_path_factory.mktemp("config") / "vl-reuse.yaml"
    path.write_text(yaml.safe_dump(config))
    with ServeProcess(path) as running:
        yield running


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Any:
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    return NemotronH_Omni_Reasoning_V3.from_pretrained(checkpoint, dtype=torch.float32).eval()


def chat(client: openai.OpenAI, history: list[dict[str, Any]]) -> tuple[str, int, int]:
    """(answer, prompt tokens, cached tokens)."""
    response = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=history,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0.0,
    )
    usage = response.usage
    assert usage is not None
    details = usage.prompt_tokens_details
    cached = 0 if details is None else details.cached_tokens or 0
    return response.choices[0].message.content or "", usage.prompt_tokens, cached


def test_turn_two_with_the_image_resumes_after_turn_one(
    server: ServeProcess, checkpoint: Path, reference: Any
) -> None:
    client = openai.OpenAI(base_url=server.url, api_key="unused", timeout=120, max_retries=0)
    for seed, image in ((1, picture(1)), (2, picture(2))):
        first = messages(LONG, data_url(image))
        answer, prompt_tokens, cached = chat(client, first)
        assert answer == expected_chat_text(checkpoint, reference, [LONG], image), seed
        # Nothing resumable yet: the other image's blocks end where this one begins.
        assert cached == 0, seed
        second = [
            *first,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": FOLLOW_UP},
        ]
        follow, _, cached = chat(client, second)
        assert follow == expected_chat_text(checkpoint, reference, [LONG, answer, FOLLOW_UP], image)
        assert cached == prompt_tokens, (seed, cached, prompt_tokens)
