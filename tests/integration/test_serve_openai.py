"""`disagg serve` as a user runs it: a subprocess driven by the official client.

One server per module (2 context + 2 generation workers, prefix-aware
routing, V2 with block reuse) on a tiny checkpoint written here. The config
is deploy/configs/2p2d.yaml written in TensorRT-LLM's keys
(tests/configs/trtllm/2p2d-python-reuse.yaml, which translates to exactly
that file), so a TensorRT-LLM config is served end to end. Greedy outputs must equal transformers'
`generate` on the same checkpoint, decoded with the same tokenizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.serve_process import start_serve, stop_group
from tests.served_metrics import gauge_sum, metric_samples, wait_until

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "tests" / "configs" / "trtllm" / "2p2d-python-reuse.yaml"
STARTUP_TIMEOUT_S = 240
MAX_TOKENS = 8


@dataclass
class Server:
    process: subprocess.Popen[str]
    url: str
    model: str
    output: list[str]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.embedded.writer import ensure_checkpoint

    return ensure_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", "llama", "tiny")


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[Server]:
    running = start_serve(CONFIG, checkpoint)
    try:
        yield Server(running.process, running.url, checkpoint.name, running.output)
    finally:
        stop_group(running.process)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> tuple[object, object]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(checkpoint)


def _greedy(reference: tuple[object, object], prompt_ids: list[int], max_tokens: int) -> str:
    model, tokenizer = reference
    with torch.no_grad():
        out = model.generate(  # type: ignore[attr-defined]
            torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False
        )
    return tokenizer.decode(out[0, len(prompt_ids) :], skip_special_tokens=True)  # type: ignore[attr-defined]


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _routed(server: Server) -> dict[tuple[str, str], float]:
    text = httpx.get(server.url.removesuffix("/v1") + "/metrics").text
    pattern = r'disagg_routed_requests_total\{phase="(\w+)",worker="([\w-]+)"\} ([0-9.]+)'
    return {(w, p): float(v) for p, w, v in re.findall(pattern, text)}


def _cached_blocks(server: Server) -> float:
    """Blocks the router knows the context workers hold."""
    return gauge_sum(server.url, "disagg_router_cached_blocks", 'worker="context-')


def _engine_steps(server: Server) -> dict[str, float]:
    samples = metric_samples(server.url, "disagg_engine_steps")
    return {labels.removeprefix('worker="').removesuffix('"'): v for labels, v in samples}


PROMPTS = ["The quick brown fox", "Once upon a time, in a small village", "Water boils at"]


def test_completions_match_transformers_greedy(server: Server, reference: tuple) -> None:
    client = _client(server)
    tokenizer = reference[1]
    for prompt in PROMPTS:
        expected = _greedy(reference, tokenizer(prompt).input_ids, MAX_TOKENS)
        whole = client.completions.create(
            model=server.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert whole.choices[0].text == expected
        assert whole.usage is not None and whole.usage.prompt_tokens == len(
            tokenizer(prompt).input_ids
        )
        stream = client.completions.create(
            model=server.model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_the_ignored_tensorrt_llm_keys_are_listed_once_at_startup(server: Server) -> None:
    text = "".join(server.output)
    assert text.count("tensorrt-llm config: 3 keys do not apply here (ignored):") == 1
    assert text.count("  context_servers.urls: this launcher starts its own workers") == 1


# The long one is tokenized on the server's tokenizer thread (`cluster.api.prompt_tokenizer`).
@pytest.mark.parametrize(
    "content",
    ["Tell me about the weather", "Tell me about the weather in the mountains. " * 28],
    ids=["short", "long"],
)
def test_chat_completions_use_the_checkpoint_template(
    server: Server, reference: tuple, content: str
) -> None:
    client = _client(server)
    messages = [{"role": "user", "content": content}]
    ids = reference[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    expected = _greedy(reference, list(ids), MAX_TOKENS)
    whole = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == expected


def _error_responses(server: Server) -> dict[tuple[str, str], float]:
    text = httpx.get(server.url.removesuffix("/v1") + "/metrics").text
    pattern = r'disagg_error_responses_total\{code="(\w+)",status="(\d+)"\} ([0-9.]+)'
    return {(status, code): float(v) for code, status, v in re.findall(pattern, text)}


def test_errors_are_openai_errors_with_the_right_status(server: Server) -> None:
    client = _client(server)
    before = _error_responses(server)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model, prompt="x", max_tokens=10**6)
    assert info.value.body["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.model, prompt="x", extra_body={"bogus": 1})
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    # Every refusal is counted in /metrics by status and code.
    after = _error_responses(server)

    def gained(key: tuple[str, str]) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert gained(("404", "model_not_found")) == 1
    assert gained(("400", "extra_forbidden")) == 1
    assert gained(("400", "context_length_exceeded")) == 1


def test_a_prompt_list_answers_each_prompt_with_its_own_greedy_text(
    server: Server, reference: tuple
) -> None:
    client = _client(server)
    listed = client.completions.create(
        model=server.model, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0
    )
    assert [c.index for c in listed.choices] == list(range(len(PROMPTS)))
    _, tokenizer = reference
    for choice, prompt in zip(listed.choices, PROMPTS, strict=True):
        ids = tokenizer(prompt)["input_ids"]  # type: ignore[operator]
        assert choice.text == _greedy(reference, ids, MAX_TOKENS)
    singles = [
        client.completions.create(
            model=server.model, prompt=p, max_tokens=MAX_TOKENS, temperature=0
        )
        for p in PROMPTS
    ]
    assert listed.usage is not None
    assert listed.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles if s.usage)
    assert listed.usage.completion_tokens == len(PROMPTS) * MAX_TOKENS


def test_model_retrieve_tokenize_detokenize_and_version(server: Server, reference: tuple) -> None:
    client = _client(server)
    assert client.models.retrieve(server.model).id == server.model
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("other-model")
    _, tokenizer = reference
    base = server.url.removesuffix("/v1")
    text = "Once upon a time"
    tokens = httpx.post(base + "/tokenize", json={"model": server.model, "prompt": text}).json()
    assert tokens["tokens"] == tokenizer(text)["input_ids"]  # type: ignore[operator]
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] > 0
    back = httpx.post(base + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back["prompt"] == tokenizer.decode(tokens["tokens"])  # type: ignore[attr-defined]
    # Chat messages give the ids a chat completion with them is prefilled with.
    messages = [{"role": "user", "content": "Hi there"}]
    chat = httpx.post(base + "/tokenize", json={"messages": messages}).json()
    rendered = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        messages, add_generation_prompt=True, tokenize=False
    )
    assert chat["tokens"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    reply = client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=1,  # type: ignore[arg-type]
    )
    assert reply.usage is not None and reply.usage.prompt_tokens == chat["count"]
    bad = httpx.post(base + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(base + "/tokenize", json={"prompt": "x", "messages": messages})
    assert both.status_code == 400 and "one of the two" in both.json()["error"]["message"]
    assert httpx.get(base + "/version").json()["version"] == "0.1.0"


def test_32_concurrent_requests_on_2p2d(server: Server, reference: tuple) -> None:
    tokenizer = reference[1]
    prompts = [f"Request number {i} asks about the {w}" for i, w in enumerate(["sea", "sky"] * 16)]

    async def run_all() -> list[str]:
        client = openai.AsyncOpenAI(
            base_url=server.url, api_key="unused", max_retries=0, timeout=120
        )
        async with client:
            results = await asyncio.gather(
                *(
                    client.completions.create(
                        model=server.model, prompt=p, max_tokens=MAX_TOKENS, temperature=0
                    )
                    for p in prompts
                )
            )
        return [r.choices[0].text for r in results]

    before, steps_before = _routed(server), _engine_steps(server)
    texts = asyncio.run(run_all())
    expected = [_greedy(reference, tokenizer(p).input_ids, MAX_TOKENS) for p in prompts]
    assert texts == expected
    after = _routed(server)
    workers = ("context-0", "context-1", "generation-0", "generation-1")
    for worker in workers:
        phase = "context" if worker.startswith("context") else "generation"
        # Both workers of each pool took part in the burst.
        assert after.get((worker, phase), 0) > before.get((worker, phase), 0)

    def every_engine_stepped() -> bool:
        steps = _engine_steps(server)
        return all(steps.get(w, 0) > steps_before.get(w, 0) for w in workers)

    assert wait_until(every_engine_stepped, 5), "the engine step gauges did not move"


def test_prefix_aware_routes_a_repeated_prefix_to_its_holder(server: Server) -> None:
    client = _client(server)
    prefix = " ".join(["The clockmaker wound every clock in the shop"] * 8)  # many full blocks
    before = _routed(server)
    known = _cached_blocks(server)
    client.completions.create(model=server.model, prompt=f"{prefix} 0", max_tokens=2, temperature=0)
    # Wait until the router has polled the holder's KV events for the prefix.
    assert wait_until(lambda: _cached_blocks(server) >= known + 4, 10), "no KV events seen"
    for i in range(1, 4):
        client.completions.create(
            model=server.model, prompt=f"{prefix} {i}", max_tokens=2, temperature=0
        )
    after = _routed(server)
    gains = {
        w: after.get((w, "context"), 0) - before.get((w, "context"), 0)
        for w in ("context-0", "context-1")
    }
    # Without prefix knowledge equal loads alternate; with it, one holder takes all.
    assert sorted(gains.values()) == [0, 4], gains


def test_client_disconnect_aborts_the_request_on_the_workers(server: Server) -> None:
    body = {
        "model": server.model,
        "prompt": "A long story begins",
        "max_tokens": 3000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", server.url + "/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        assert [next(lines) for _ in range(3)]
        assert wait_until(lambda: gauge_sum(server.url, "disagg_worker_requests") > 0, 5), (
            "request never ran"
        )
        assert wait_until(lambda: gauge_sum(server.url, "disagg_kv_cache_usage_ratio") > 0, 5), (
            "no blocks in use"
        )
    # Closing the stream must stop generation long before 3000 tokens are done,
    # and every block (context and generation side) must be free again.
    assert wait_until(lambda: gauge_sum(server.url, "disagg_worker_requests") == 0, 3), (
        "request kept running"
    )
    assert wait_until(lambda: gauge_sum(server.url, "disagg_kv_cache_usage_ratio") == 0, 3), (
        "blocks leaked"
    )


def test_bench_measures_the_endpoint(
    server: Server, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cluster.cli import main

    base = server.url.removesuffix("/v1")  # the server root works as well as the /v1 root
    argv = ["bench", "--base-url", base, "--num-prompts", "8", "--input-len", "24"]
    argv += ["--output-len", "6", "--ignore-eos", "--tokenizer", str(checkpoint)]
    argv += ["--max-concurrency", "4", "--slo-ttft-ms", "60000", "--json", "--no-progress"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["completed"], summary["failed"]) == (8, 0)
    assert summary["total_token_throughput"] > summary["output_token_throughput"] > 0
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])
    assert 0 < summary["ttft"]["p50_ms"] <= summary["ttft"]["p99_ms"]
    assert summary["tpot"]["p50_ms"] > 0


def _descendants(root: int) -> dict[int, str]:
    """pid -> command line of every process below `root` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            with contextlib.suppress(OSError):
                found[child] = (Path("/proc") / str(child) / "cmdline").read_bytes().decode()
            todo.append(child)
    return found


def test_a_killed_context_worker_is_routed_around(server: Server) -> None:
    workers = [
        pid for pid, cmd in _descendants(server.process.pid).items() if "ContextWorker" in cmd
    ]
    assert len(workers) == 2, "expected two context worker processes"
    os.kill(workers[0], signal.SIGKILL)
    client = _client(server)
    for i in range(4):  # some would land on the dead worker without retry / health polling
        reply = client.completions.create(
            model=server.model, prompt=f"after the failure {i}", max_tokens=3, temperature=0
        )
        assert reply.choices[0].finish_reason == "length"
    # Ray restarts the killed actor; the router polls it back into service.
    health_url = server.url.removesuffix("/v1") + "/health"
    deadline = time.monotonic() + 90
    healthy = httpx.get(health_url).json()["healthy_workers"]
    while healthy != {"context": 2, "generation": 2} and time.monotonic() < deadline:
        assert healthy["generation"] == 2 and healthy["context"] in (1, 2), healthy
        time.sleep(0.5)
        healthy = httpx.get(health_url).json()["healthy_workers"]
    assert healthy == {"context": 2, "generation": 2}
    reply = client.completions.create(
        model=server.model, prompt="after the restart", max_tokens=3, temperature=0
    )
    assert reply.choices[0].finish_reason == "length"


def test_sigterm_stops_the_server_cleanly(server: Server) -> None:
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(60) == 0
    time.sleep(0.2)
    assert any(line.startswith("stopped") for line in server.output), server.output[-10:]
    assert any("received SIGTERM, stopping" in line for line in server.output), server.output[-10:]


def test_a_busy_port_fails_before_any_worker_starts(checkpoint: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "cluster.cli",
                "serve",
                "--model",
                str(checkpoint),
                "--port",
                port,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Ray" not in result.stderr  # refused before connecting to Ray


def test_demo_runs_the_whole_path_and_stops(tmp_path: Path, checkpoint: Path) -> None:
    # On the tiny checkpoint: the default model's answers are checked in
    # test_serve_default_model.py.
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "cluster.cli", "demo", "--max-tokens", "6"]
    result = subprocess.run(
        [*command, "--model", str(checkpoint)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert len(re.findall(r"\d+ tokens, TTFT \d+ ms, [0-9.]+ tokens/s", result.stdout)) == 3
    assert result.stdout.rstrip().endswith("cluster stopped")
