"""n samples from one prefill, served (`disagg serve`, aggregated and 1P1D,
1P1D also with block reuse and n-gram speculation, and a Nemotron-H hybrid
in 1P1D), through the `openai`
client: indexed choices with the prompt counted once, greedy samples equal
to the greedy answer, prompt lists answered prompt by prompt, and /metrics
showing that an n = 4 request prefilled its prompt once and moved its cache
once."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.serve_process import MODES as SERVE_MODES
from tests.serve_process import ServeProcess, start_mode, stop_group
from tests.served_metrics import gauge_sum, wait_until

MODES = {
    **SERVE_MODES,
    # A hybrid: each sample's Mamba state is a copy of the pulled one.
    "1p1d-nemotron_h": SERVE_MODES["1p1d"],
}


@pytest.fixture(scope="module", params=sorted(MODES))
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path, ServeProcess]]:
    from models.embedded.writer import ensure_checkpoint

    mode = request.param
    arch = "nemotron_h" if mode.endswith("nemotron_h") else "llama"
    checkpoint = ensure_checkpoint(tmp_path_factory.getbasetemp() / f"n-{arch}", arch, "tiny")
    running = start_mode(tmp_path_factory.mktemp(f"n-{mode}"), checkpoint, MODES[mode])
    try:
        yield mode, checkpoint, running
    finally:
        stop_group(running.process)


def prompt(seed: int, length: int = 37) -> list[int]:
    rng = random.Random(seed)
    passage = [rng.randrange(10, 400) for _ in range(length - 6)]
    return passage + passage[:6]


def test_n_choices_from_one_prefill(server: tuple[str, Path, ServeProcess]) -> None:
    mode, checkpoint, running = server
    client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=120)
    greedy = {"model": checkpoint.name, "max_tokens": 12, "temperature": 0}
    ids = prompt(1)
    one = client.completions.create(prompt=ids, **greedy)  # type: ignore[call-overload]
    two = client.completions.create(prompt=ids, n=2, **greedy)  # type: ignore[call-overload]
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.text for c in two.choices] == [one.choices[0].text] * 2, mode
    assert two.usage.prompt_tokens == len(ids) == one.usage.prompt_tokens

    ids_body = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    seeded = {"model": checkpoint.name, "seed": 11, "logprobs": 0}
    sampled = client.completions.create(  # type: ignore[call-overload]
        prompt=ids, max_tokens=8, n=3, **seeded, extra_body=ids_body
    )
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2]
    assert sampled.usage is not None
    assert sampled.usage.prompt_tokens == len(ids)
    assert sampled.usage.completion_tokens == 24
    again = client.completions.create(  # type: ignore[call-overload]
        prompt=ids, max_tokens=8, n=3, **seeded, extra_body=ids_body
    )
    assert [c.text for c in again.choices] == [c.text for c in sampled.choices]

    # Every sample ends at its first token: nothing moves, three choices come back.
    short = client.completions.create(prompt=ids, n=3, max_tokens=1, **seeded)  # type: ignore[call-overload]
    assert [c.finish_reason for c in short.choices] == ["length"] * 3
    # Sample 0 ends at its first token, the others run on from the same cache.
    first = _first_token(sampled.choices[0])
    others = [c for c in sampled.choices[1:] if _first_token(c) != first]
    stopped = client.completions.create(  # type: ignore[call-overload]
        prompt=ids, n=3, max_tokens=8, **seeded, extra_body=ids_body | {"stop_token_ids": [first]}
    )
    assert stopped.choices[0].finish_reason == "stop"
    for before in others:
        after = stopped.choices[before.index]
        tokens = _tokens(before)
        want = tokens[: tokens.index(first)] if first in tokens else tokens
        assert _tokens(after)[: len(want)] == want, mode

    chat = client.chat.completions.create(
        model=checkpoint.name,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=6,
        n=3,
        stream=True,
    )
    indices = {chunk.choices[0].index for chunk in chat if chunk.choices}
    assert indices == {0, 1, 2}


def _tokens(choice: Any) -> list[int]:
    """A choice's token ids (asked for as `token_id:N` logprobs)."""
    return [int(name.removeprefix("token_id:")) for name in choice.logprobs.tokens]


def _first_token(choice: Any) -> int:
    return _tokens(choice)[0]


def test_a_prompt_list_answers_each_prompt_with_its_own_text(
    server: tuple[str, Path, ServeProcess],
) -> None:
    _, checkpoint, running = server
    client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=120)
    greedy = {"model": checkpoint.name, "max_tokens": 10, "temperature": 0}
    prompts = [prompt(2), prompt(3, 29)]
    alone = [client.completions.create(prompt=p, **greedy).choices[0].text for p in prompts]  # type: ignore[call-overload]
    listed = client.completions.create(prompt=prompts, n=2, **greedy)  # type: ignore[call-overload]
    assert [c.index for c in listed.choices] == [0, 1, 2, 3]
    assert [c.text for c in listed.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert listed.usage.prompt_tokens == sum(map(len, prompts))


def test_n_4_prefills_once_and_moves_the_cache_once(
    server: tuple[str, Path, ServeProcess],
) -> None:
    mode, checkpoint, running = server
    client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=120)
    ids = prompt(4, 45)
    body = {"model": checkpoint.name, "prompt": ids, "max_tokens": 6, "temperature": 0}
    phase = 'phase="whole"' if mode == "aggregated" else 'phase="context"'

    def totals() -> tuple[float, float, float]:
        return (
            gauge_sum(running.url, "disagg_routed_requests_total", phase),
            gauge_sum(running.url, "disagg_kv_transfer_bytes_total"),
            gauge_sum(running.url, "disagg_prompt_tokens_total"),
        )

    before = totals()
    client.completions.create(**body)  # type: ignore[call-overload]
    after_one = totals()
    reply = client.completions.create(n=4, **body)  # type: ignore[call-overload]
    assert len(reply.choices) == 4
    after_four = totals()
    one = [b - a for a, b in zip(before, after_one, strict=True)]
    four = [b - a for a, b in zip(after_one, after_four, strict=True)]
    # One prefill dispatched, the same bytes moved, the prompt counted once.
    assert one == four, (mode, one, four)
    assert one[0] == 1 and one[2] == len(ids)
    assert (one[1] > 0) == (mode != "aggregated")


def test_a_client_that_leaves_an_n_3_stream_frees_every_sample(
    server: tuple[str, Path, ServeProcess],
) -> None:
    mode, checkpoint, running = server
    body = {
        "model": checkpoint.name,
        "prompt": prompt(6, 40),
        "max_tokens": 1500,
        "ignore_eos": True,
        "temperature": 0.9,
        "n": 3,
        "stream": True,
    }
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", running.url + "/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        seen: set[int] = set()
        while len(seen) < 3:  # every sample is decoding
            line = next(lines)
            if line.startswith("data: {"):
                seen.update(c["index"] for c in json.loads(line[6:])["choices"])
        assert wait_until(lambda: gauge_sum(running.url, "disagg_kv_cache_usage_ratio") > 0, 5)
    # Closing the stream stops all three samples and frees every block and slot.
    assert wait_until(lambda: gauge_sum(running.url, "disagg_worker_requests") == 0, 5), mode
    assert wait_until(lambda: gauge_sum(running.url, "disagg_kv_cache_usage_ratio") == 0, 5), mode
