"""Routing that knows where Mamba snapshots live: a Nemotron-H hybrid served
with one context and two generation workers, block reuse on, prefix-aware
routing and `max_local_prefill_length: 32`; the generation instances are
two tensor-parallel ranks each (the context instance one: each generation
rank pulls its heads and Mamba channels), so a snapshot's copies run on
every rank.

Turn 1 of each conversation (a 50-token prompt) is disaggregated: the
context worker prefills, a generation worker decodes and keeps the
conversation's blocks and its end-of-sequence snapshot. Turn 2 adds 6
uncached tokens (the last answer token, never fed back, and 5 new ones), so
it runs whole on the generation worker holding that snapshot: nothing
crosses the wire, `cached_tokens` shows the skipped prefix, and that
worker's snapshot hits count it. Answers equal transformers' full-forward
greedy tokens.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.integration.test_serve_hybrid_reuse import full_forward_greedy
from tests.serve_process import ServeProcess, start_serve, stop_group

NEW_TOKENS = 6
CONVERSATIONS = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.embedded.writer import ensure_checkpoint

    return ensure_checkpoint(tmp_path_factory.mktemp("hybrid") / "nemotron_h", "nemotron_h", "tiny")


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    config = {
        "model": str(checkpoint),
        "router": {"type": "prefix_aware"},
        "conditional_disagg": {"max_local_prefill_length": 32},
        "kv_cache": {"manager": "v2", "enable_block_reuse": True, "max_tokens": 2048},
        "max_batch_size": 4,
        "context_servers": {"num_instances": 1},
        "generation_servers": {"num_instances": 2, "tensor_parallel_size": 2},
    }
    path = tmp_path_factory.mktemp("routing") / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    running = start_serve(path, checkpoint)
    try:
        yield running
    finally:
        stop_group(running.process)


def _metric(server: ServeProcess, name: str) -> dict[tuple[str, ...], float]:
    text = httpx.get(server.url.removesuffix("/v1") + "/metrics").text
    found = {}
    for labels, value in re.findall(rf"^{name}\{{([^}}]*)\}} ([0-9.e+]+)$", text, re.M):
        found[tuple(sorted(re.findall(r'(\w+)="([^"]*)"', labels)))] = float(value)
    return found


def _wait_for_snapshots(server: ServeProcess, count: int) -> None:
    """The router learns of snapshots from its polls (every 0.25 s)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        used = _metric(server, "disagg_mamba_snapshots")
        gen = [v for k, v in used.items() if ("kind", "used") in k and "generation" in str(k)]
        if sum(gen) >= count:
            return
        time.sleep(0.1)
    raise AssertionError(f"the generation workers report fewer than {count} snapshots: {used}")


def test_turn_two_runs_on_the_generation_worker_holding_turn_ones_snapshot(
    server: ServeProcess, checkpoint: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    rng = random.Random(11)
    prompts = [[rng.randrange(10, 500) for _ in range(50)] for _ in range(CONVERSATIONS)]

    def ask(prompt: list[int]) -> tuple[list[int], int]:
        expected, _ = full_forward_greedy(model, prompt, NEW_TOKENS)
        reply = client.completions.create(
            model=checkpoint.name,
            prompt=prompt,
            max_tokens=NEW_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert reply.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
        details = reply.usage.prompt_tokens_details
        return expected, 0 if details is None else details.cached_tokens or 0

    answers = [ask(prompt)[0] for prompt in prompts]
    _wait_for_snapshots(server, CONVERSATIONS)
    routed = _metric(server, "disagg_routed_requests_total")
    context_before = sum(v for k, v in routed.items() if ("phase", "context") in k)
    skipped = 0
    for prompt, answer in zip(prompts, answers, strict=True):
        turn2 = prompt + answer + [rng.randrange(10, 500) for _ in range(5)]
        _, cached = ask(turn2)
        assert cached == len(turn2) - 6
        skipped += cached
    text = httpx.get(server.url.removesuffix("/v1") + "/metrics").text
    assert f"disagg_cached_prompt_tokens_sum {float(skipped)}" in text
    routed = _metric(server, "disagg_routed_requests_total")
    assert sum(v for k, v in routed.items() if ("phase", "context") in k) == context_before
    whole = {dict(k)["worker"]: v for k, v in routed.items() if ("phase", "whole") in k}
    deadline = time.monotonic() + 10  # the hit counts arrive with the next polls
    while True:
        hits = {
            dict(k)["worker"]: v
            for k, v in _metric(server, "disagg_mamba_snapshots").items()
            if ("kind", "hit") in k and "generation" in dict(k)["worker"]
        }
        if sum(hits.values()) >= CONVERSATIONS or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    # Every turn 2 ran whole on a generation worker, and each found its snapshot there.
    assert sum(whole.values()) == CONVERSATIONS
    assert hits == {worker: whole.get(worker, 0.0) for worker in hits}, (hits, whole)
