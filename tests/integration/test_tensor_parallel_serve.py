"""`disagg serve` with a tensor-parallel generation instance (TP 2 on CPU, gloo).

One server for the module, aggregated only: one generation instance of two
ranks (rank 0 the worker, rank 1 its actor) that runs whole requests. The tiny Llama checkpoint has 4 query and 2 KV heads, so each rank
holds 2 query heads, 1 KV head and half the vocabulary. Greedy text through
the OpenAI API must equal transformers' `generate` on the same checkpoint,
and `/metrics` shows each rank's cache.
The same runs for a tiny Nemotron-H (Mamba2, attention, MLP and MoE layers;
each rank holds half the Mamba heads and one of the two B/C groups).
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.integration.test_serve_openai import Server, _greedy
from tests.serve_process import start_serve, stop_group

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 12
RECOVERY_TIMEOUT_S = 180
PROMPTS = ["The quick brown fox", "Once upon a time, in a small village, there lived", "Water"]


@pytest.fixture(scope="module", params=["llama", "nemotron_h"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.embedded.writer import ensure_checkpoint

    arch = request.param
    return ensure_checkpoint(tmp_path_factory.mktemp("ckpt") / f"tiny-{arch}", arch, "tiny")


@contextmanager
def serving(checkpoint: Path, sections: dict[str, Any], folder: Path) -> Iterator[Server]:
    """`disagg serve` of the checkpoint with these context/generation sections."""
    config = {"model": str(checkpoint), "kv_cache": {"max_tokens": 512}, "max_batch_size": 4}
    path = folder / "tp.yaml"
    path.write_text(yaml.safe_dump({**config, **sections}))
    running = start_serve(path, checkpoint)
    try:
        yield Server(running.process, running.url, checkpoint.name, running.output)
    finally:
        stop_group(running.process)


def assert_greedy_text_matches_transformers(server: Server, checkpoint: Path) -> None:
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


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    sections = {
        "context_servers": {"num_instances": 0},
        "generation_servers": {"num_instances": 1, "tensor_parallel_size": 2},
    }
    with serving(checkpoint, sections, tmp_path_factory.mktemp("config")) as running:
        yield running


def test_the_plan_shows_two_ranks_on_the_generation_instance(server: Server) -> None:
    plan = [line for line in server.output if line.startswith("generation-0")]
    assert plan and "cpu x2" in plan[0]


def _rank_samples(server: Server) -> dict[tuple[str, str, str], float]:
    """`disagg_rank_*` samples of the generation instance: (name, rank, state) -> value."""
    text = httpx.get(server.url.removesuffix("/v1") + "/metrics", timeout=30).text
    return {
        (m["name"], m["rank"], m["state"]): float(m["value"])
        for m in re.finditer(
            r'(?P<name>disagg_rank_\w+)\{rank="(?P<rank>\d)",state="(?P<state>\w+)",'
            r'worker="generation-0"\} (?P<value>\S+)',
            text,
        )
    }


def test_metrics_show_each_ranks_cache(server: Server, checkpoint: Path) -> None:
    deadline = time.monotonic() + 10  # the router polls its workers' load
    while not (samples := _rank_samples(server)):
        assert time.monotonic() < deadline, "no per-rank cache samples in /metrics"
        time.sleep(0.2)
    blocks = [samples[("disagg_rank_kv_blocks", rank, "total")] for rank in "01"]
    assert blocks[0] > 0 and blocks[0] == blocks[1], samples
    assert samples[("disagg_rank_kv_blocks", "1", "used")] >= 0
    slots = [samples.get(("disagg_rank_mamba_slots", rank, "total")) for rank in "01"]
    if checkpoint.name.endswith("nemotron_h"):
        assert slots[0] and slots[0] == slots[1], samples
    else:
        assert slots == [None, None], samples


def test_greedy_text_matches_transformers(server: Server, checkpoint: Path) -> None:
    assert_greedy_text_matches_transformers(server, checkpoint)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found


def _rank_actor_pid(server: Server) -> int:
    for pid in _descendants(server.process.pid):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"TensorParallelRank" in title:
            return pid
    raise AssertionError("no TensorParallelRank process under the server")


def _niceness(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


@pytest.mark.parametrize("checkpoint", ["llama"], indirect=True)
def test_the_other_rank_runs_at_the_servers_niceness(server: Server) -> None:
    """Not at the 15 Ray starts its workers with: rank 0 passes its own
    environment's `RAY_worker_niceness` on (`engine.process_env`)."""
    assert _niceness(_rank_actor_pid(server)) == _niceness(server.process.pid)


# Once, on the Llama server: what a lost rank does to its instance does not
# depend on the layers between the collectives.
@pytest.mark.parametrize("checkpoint", ["llama"], indirect=True)
def test_a_dead_rank_fails_its_request_then_the_instance_returns_with_fresh_ranks(
    server: Server, checkpoint: Path
) -> None:
    """Runs last. Rank 0's step fails on the lost collective, so it exits and
    Ray restarts the instance, which starts a new rank; the router routes
    around it meanwhile and uses it again once it answers."""
    os.kill(_rank_actor_pid(server), signal.SIGKILL)
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.APIError) as failure:
        client.completions.create(model=server.model, prompt="Water", max_tokens=4, temperature=0)
    assert not isinstance(failure.value, openai.APITimeoutError), "it hung instead"
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    expected = _greedy((model, tokenizer), tokenizer(PROMPTS[0]).input_ids, MAX_TOKENS)
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while True:
        try:
            whole = client.completions.create(
                model=server.model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0
            )
            break
        except openai.APIError:
            assert time.monotonic() < deadline, "the instance did not come back"
            time.sleep(1)
    assert whole.choices[0].text == expected
    assert server.process.poll() is None
