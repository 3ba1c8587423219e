"""`disagg serve` on a Ray cluster of three nodes, one machine: context on one
node, generation on another, placed by the sections' `resources:`.

The cluster (one per module) is a head at 127.0.0.2 with no CPUs, a node at
127.0.0.3 offering the custom resource `prefill` and one at 127.0.0.4
offering `decode`, each started with `ray start` (tests/ray_nodes.py). Greedy
outputs must equal transformers' `generate` on the same checkpoint while every
cache moves between the two node addresses.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.ray_nodes import RayCluster, new_cluster, remove_cluster_files, start_node
from tests.serve_process import ServeProcess, start_serve, stop_group

HEAD, PREFILL_NODE = "127.0.0.2", "127.0.0.3"
DECODE_NODES = ("127.0.0.4", "127.0.0.5")
PROMPTS = ["The quick brown fox", "Once upon a time, in a small village"]
MAX_TOKENS = 6
# Long enough that streams still run when a node is killed a few chunks in.
LONG_STREAM_TOKENS = 1500


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    cluster = new_cluster()
    try:
        start_node(cluster, HEAD, num_cpus=0)
        start_node(cluster, PREFILL_NODE, num_cpus=2, resources={"prefill": 2})
        for ip in DECODE_NODES:  # one generation instance each
            start_node(cluster, ip, num_cpus=1, resources={"decode": 1})
        yield cluster
    finally:
        cluster.stop()
        remove_cluster_files(cluster)


def _config(
    tmp_path: Path,
    cluster: RayCluster,
    backend: str,
    num_generation: int = 1,
    cache_tokens: int = 256,
) -> Path:
    config = {
        "model": "set-by-the-command-line",
        "address": cluster.address,
        "cache_transceiver": {"backend": backend, "timeout_s": 60},
        "kv_cache": {"block_size": 16, "max_tokens": cache_tokens},
        "max_num_tokens": 128,
        "max_batch_size": 4,
        "context_servers": {"num_instances": 1, "resources": {"prefill": 1}},
        "generation_servers": {"num_instances": num_generation, "resources": {"decode": 1}},
    }
    path = tmp_path / f"multinode-{backend}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from models.embedded.writer import ensure_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {arch: ensure_checkpoint(root / arch, arch, "tiny") for arch in ("llama", "nemotron_h")}


def _greedy(checkpoint: Path, prompt: str) -> str:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer(prompt).input_ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return str(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))


def _check_greedy_completions(server: ServeProcess, checkpoint: Path) -> None:
    for prompt in PROMPTS:
        body = {"model": checkpoint.name, "prompt": prompt, "max_tokens": MAX_TOKENS}
        reply = httpx.post(
            server.url + "/completions", json={**body, "temperature": 0}, timeout=120
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == _greedy(checkpoint, prompt)


def _listening_addresses(cluster: RayCluster, marker: str) -> set[str]:
    """The addresses that worker processes whose command line holds `marker`
    listen on, less Ray's own RPC port (in the node's worker port range, and
    bound to every interface by Ray itself)."""
    addresses: set[str] = set()
    for node in cluster.nodes:
        node.remember_descendants()
        for pid in node.descendants:
            try:
                proc = psutil.Process(pid)
                if marker not in " ".join(proc.cmdline()):
                    continue
                for conn in proc.net_connections(kind="tcp"):
                    if (
                        conn.status == psutil.CONN_LISTEN
                        and conn.laddr.port not in node.worker_ports
                    ):
                        addresses.add(conn.laddr.ip)
            except psutil.NoSuchProcess:
                continue
    return addresses


@pytest.mark.parametrize(
    "arch,backend",
    [("llama", "python"), ("llama", "nixl"), ("nemotron_h", "python"), ("nemotron_h", "nixl")],
)
def test_context_and_generation_on_two_nodes_match_transformers(
    ray_cluster: RayCluster,
    checkpoints: dict[str, Path],
    tmp_path: Path,
    arch: str,
    backend: str,
) -> None:
    checkpoint = checkpoints[arch]
    config = _config(tmp_path, ray_cluster, backend)
    server: ServeProcess = start_serve(config, checkpoint, env=ray_cluster.env)
    try:
        output = "".join(server.output)
        assert f"context-0 on {PREFILL_NODE}" in output, output
        decode_node = re.search(r"generation-0 on ([\d.]+)", output)
        assert decode_node and decode_node.group(1) in DECODE_NODES, output
        metrics = httpx.get(server.base + "/metrics").text
        nodes = dict(re.findall(r'disagg_worker_node\{node="([\d.]+)",role="(\w+)"', metrics))
        assert nodes == {PREFILL_NODE: "context", decode_node.group(1): "generation"}, metrics
        _check_greedy_completions(server, checkpoint)
        routed = re.findall(
            r'disagg_routed_requests_total\{phase="(\w+)"', httpx.get(server.base + "/metrics").text
        )
        assert "context" in routed and "generation" in routed
        if backend == "python":  # the cache listeners bind to their node, not 0.0.0.0
            assert _listening_addresses(ray_cluster, "ContextWorker") == {PREFILL_NODE}
    finally:
        stop_group(server.process)


def _stream(server: ServeProcess, model: str, prompt: str, started: threading.Event) -> str:
    """Stream one completion; 'done' if it ended with [DONE] after a finish
    reason, else 'error: ...' (an error event, or the stream cut short)."""
    body = {"model": model, "prompt": prompt, "max_tokens": LONG_STREAM_TOKENS, "temperature": 0}
    body["ignore_eos"] = True
    finished = False
    try:
        with httpx.stream(
            "POST", server.url + "/completions", json={**body, "stream": True}, timeout=120
        ) as reply:
            if reply.status_code != 200:
                return f"error: HTTP {reply.status_code} {reply.read()!r}"
            for count, line in enumerate(reply.iter_lines()):
                if count == 10:  # a few tokens in
                    started.set()
                if line.startswith("data: {"):
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        return f"error: {event['error']}"
                    finished = finished or any(c.get("finish_reason") for c in event["choices"])
                elif line == "data: [DONE]":
                    return "done" if finished else "error: [DONE] without a finish reason"
    except httpx.HTTPError as exc:
        return f"error: {exc}"
    return "error: the stream ended without [DONE]"


def test_a_lost_generation_node_fails_its_streams_and_the_rest_keep_serving(
    ray_cluster: RayCluster, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Runs last: it kills one of the module cluster's nodes."""
    checkpoint = checkpoints["llama"]
    config = _config(tmp_path, ray_cluster, "python", num_generation=2, cache_tokens=4096)
    server = start_serve(config, checkpoint, ray_cluster.env)
    try:
        output = "".join(server.output)
        victim_ip = re.search(r"generation-1 on ([\d.]+)", output)
        assert victim_ip, output
        victim = next(n for n in ray_cluster.nodes if n.ip == victim_ip.group(1))
        results: list[str] = [""] * 4
        started = [threading.Event() for _ in results]

        def run(i: int) -> None:
            results[i] = _stream(server, checkpoint.name, PROMPTS[i % 2], started[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(results))]
        for thread in threads:
            thread.start()
        assert all(event.wait(120) for event in started)
        victim.stop(signal.SIGKILL)  # the node's whole process group, at once
        for thread in threads:
            thread.join(180)
        # Streams running on the lost node end with an error naming it; the
        # others finish.
        errors = [r for r in results if r != "done"]
        assert errors and all("generation-1" in e for e in errors), results
        assert len(errors) < len(results), results

        def health() -> dict[str, object]:
            return dict(httpx.get(server.base + "/health", timeout=30).json())

        deadline = time.monotonic() + 120
        while health()["healthy_workers"] != {"context": 1, "generation": 1}:
            assert time.monotonic() < deadline, health()
            time.sleep(1)
        # The survivors serve new requests, and hold nothing once they are done.
        _check_greedy_completions(server, checkpoint)
        time.sleep(2)  # a poll of every worker's load
        metrics = httpx.get(server.base + "/metrics").text
        held = re.findall(
            r'disagg_worker_requests\{worker="(context-0|generation-0)"\} (\S+)', metrics
        )
        assert {w: float(v) for w, v in held} == {"context-0": 0.0, "generation-0": 0.0}, metrics
    finally:
        stop_group(server.process)
