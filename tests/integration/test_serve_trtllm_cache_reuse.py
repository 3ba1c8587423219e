"""A config in the shape of TensorRT-LLM's disagg_config_cache_reuse.yaml, served.

tests/configs/trtllm/cache-reuse-fractions.yaml sets a top-level
`free_gpu_memory_fraction` and a smaller one in the generation section's
`kv_cache_config`, with block reuse on both sides. Served 1P1D on a tiny
checkpoint, its greedy completions equal transformers', each side's cache
has the blocks its own fraction gives (the generation side's fraction is
half the context side's, so it holds half the blocks), and a repeated
prompt is served from the context worker's reused blocks.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.serve_process import ServeProcess, start_serve, stop_group

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "trtllm" / "cache-reuse-fractions.yaml"
PROMPT = "The quick brown fox jumps over the lazy dog, and then the dog " * 3
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.embedded.writer import ensure_checkpoint

    return ensure_checkpoint(tmp_path_factory.mktemp("reuse") / "tiny-llama", "llama", "tiny")


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[ServeProcess]:
    running = start_serve(CONFIG, checkpoint)
    try:
        yield running
    finally:
        stop_group(running.process)


def _metric(server: ServeProcess, pattern: str) -> dict[str, float]:
    text = httpx.get(server.url.removesuffix("/v1") + "/metrics").text
    return {key: float(value) for key, value in re.findall(pattern, text)}


def test_greedy_text_equals_transformers_and_a_repeat_reuses_the_prefix(
    server: ServeProcess, checkpoint: Path
) -> None:
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    expected = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    usages = []
    for _ in range(2):
        reply = client.completions.create(
            model=checkpoint.name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
        )
        assert reply.choices[0].text == expected
        usages.append(reply.usage)
    details = [u.prompt_tokens_details for u in usages]
    cached = [0 if d is None else (d.cached_tokens or 0) for d in details]
    assert cached[0] == 0 and cached[1] > 0, cached


def test_each_side_holds_the_blocks_of_its_own_fraction(server: ServeProcess) -> None:
    pattern = r'disagg_rank_kv_blocks\{rank="0",state="total",worker="([\w-]+)"\} ([0-9.e+]+)'
    deadline = time.monotonic() + 10  # the router polls its workers' load
    while len(blocks := _metric(server, pattern)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert set(blocks) == {"context-0", "generation-0"}, blocks
    # 0.02 (inherited from the top level) against the generation side's own 0.01,
    # both of the same per-rank share of this host's memory.
    assert abs(blocks["context-0"] - 2 * blocks["generation-0"]) <= 2, blocks
    assert blocks["generation-0"] > 1000, blocks
