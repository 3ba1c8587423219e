"""`disagg serve` on a Ray cluster of several nodes, one machine: context on
one node, generation on others, placed by the sections' `resources:`.

The cluster (one per module) is a head at 127.0.0.2 with no CPUs, a node at
127.0.0.3 offering the custom resource `prefill` and two (127.0.0.4 and .5)
offering `decode`, each started with `ray start` (tests/ray_nodes.py). Greedy
outputs must equal transformers' `generate` on the same checkpoint while every
cache moves between node addresses.

A node at 127.0.0.6 (resource `fresh`, started only by the GGUF test) runs
under `unshare` with an empty tmpfs over the checkpoints' folder: its
instance must get the model copied from the serving node. The restart test
adds two more, the second of them hidden the same way.
The `ray up` test runs the on-premise YAML's setup commands in a scratch home
and then the README's serve command against this cluster.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import site
import subprocess
import threading
import time
import venv
from collections.abc import Iterator
from pathlib import Path

import gguf
import httpx
import psutil
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.checkpoint_copy import CACHE_ENV
from models.checkpoint_manifest import manifest_of
from models.checkpoint_source import checkpoint_folder
from models.gguf.cache import CACHE_ENV as GGUF_CACHE_ENV
from tests.ray_nodes import RayCluster, new_cluster, remove_cluster_files, start_node
from tests.serve_process import ServeProcess, start_serve, start_serve_command, stop_group

HEAD, PREFILL_NODE = "127.0.0.2", "127.0.0.3"
DECODE_NODES = ("127.0.0.4", "127.0.0.5")
# A node that sees an empty folder where the checkpoints are.
FRESH_NODE = "127.0.0.6"
# Two nodes offering `moving`: an instance starts on the first (which has the
# files); when that node dies, Ray restarts it on the second (which has not).
MOVING_NODES = ("127.0.0.7", "127.0.0.8")
ROOT = Path(__file__).resolve().parents[2]
ONPREM_YAML = ROOT / "deploy" / "ray" / "cluster-onprem.yaml"
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
    generation_resource: str = "decode",
) -> Path:
    config = {
        "model": "set-by-the-command-line",
        "address": cluster.address,
        "cache_transceiver": {"backend": backend, "timeout_s": 60},
        "kv_cache": {"block_size": 16, "max_tokens": cache_tokens},
        "max_num_tokens": 128,
        "max_batch_size": 4,
        "context_servers": {"num_instances": 1, "resources": {"prefill": 1}},
        "generation_servers": {
            "num_instances": num_generation,
            "resources": {generation_resource: 1},
        },
    }
    path = tmp_path / f"multinode-{backend}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from models.embedded.writer import ensure_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {arch: ensure_checkpoint(root / arch, arch, "tiny") for arch in ("llama", "nemotron_h")}


@pytest.fixture(scope="module")
def gguf_file(checkpoints: dict[str, Path]) -> Path:
    from tests.gguf_files import write_tiny_llama_gguf

    path = checkpoints["llama"].parent / "tiny-gguf.gguf"
    write_tiny_llama_gguf(path, gguf.GGMLQuantizationType.Q8_0)
    return path


@pytest.fixture(scope="module")
def fresh_node(
    ray_cluster: RayCluster, checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A node offering `fresh`, under an empty tmpfs over the checkpoints'
    folder, with caches of its own; returns the folder holding those."""
    caches = tmp_path_factory.mktemp("fresh-node")
    env = {CACHE_ENV: str(caches / "checkpoints"), GGUF_CACHE_ENV: str(caches / "gguf")}
    hidden = checkpoints["llama"].parent
    start_node(ray_cluster, FRESH_NODE, 1, {"fresh": 1}, hidden=hidden, env=env)
    return caches


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
        # The server's log (the router's warnings) says why a request failed.
        assert reply.status_code == 200, reply.text + "".join(server.output)[-6000:]
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


def _check_placed_and_serving(server: ServeProcess, checkpoint: Path) -> None:
    """Context on the prefill node, each generation instance on a decode
    node (as the plan printed and /metrics say), completions equal to
    transformers' while every cache crosses between node addresses."""
    output = "".join(server.output)
    assert f"context-0 on {PREFILL_NODE}" in output, output
    generation = dict(re.findall(r"(generation-\d+) on ([\d.]+)", output))
    assert generation and set(generation.values()) <= set(DECODE_NODES), output
    assert len(set(generation.values())) == len(generation), output  # one per node
    metrics = httpx.get(server.base + "/metrics").text
    nodes = dict(re.findall(r'disagg_worker_node\{node="([\d.]+)",role="(\w+)"', metrics))
    expected = {PREFILL_NODE: "context"} | dict.fromkeys(generation.values(), "generation")
    assert nodes == expected, metrics
    _check_greedy_completions(server, checkpoint)
    routed = re.findall(
        r'disagg_routed_requests_total\{phase="(\w+)"', httpx.get(server.base + "/metrics").text
    )
    assert "context" in routed and "generation" in routed


# Each transceiver and each model family across nodes once: Nemotron-H on
# NIXL here, Llama on the Python transceiver in the lost-node test below.
# Crossing a node changes addresses, not what a model moves: Llama on NIXL
# and Nemotron-H on the Python transceiver run on one node in
# test_workers_parity.py.
def test_nemotron_h_on_nixl_across_two_nodes_matches_transformers(
    ray_cluster: RayCluster, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    checkpoint = checkpoints["nemotron_h"]
    config = _config(tmp_path, ray_cluster, "nixl")
    server: ServeProcess = start_serve(config, checkpoint, env=ray_cluster.env)
    try:
        _check_placed_and_serving(server, checkpoint)
    finally:
        stop_group(server.process)


def test_a_gguf_model_reaches_a_node_without_it_and_is_converted_there(
    ray_cluster: RayCluster, gguf_file: Path, fresh_node: Path, tmp_path: Path
) -> None:
    head_cache = tmp_path / "gguf-cache"
    config = _config(tmp_path, ray_cluster, "python", generation_resource="fresh")
    server = start_serve(config, gguf_file, {**ray_cluster.env, GGUF_CACHE_ENV: str(head_cache)})
    try:
        output = "".join(server.output)
        assert f"generation-0: copying {gguf_file.name} (" in output, output
        converted = list((fresh_node / "gguf").glob(f"*/{gguf_file.stem}/config.json"))
        assert len(converted) == 1, output
        _check_greedy_completions(server, checkpoint_folder(gguf_file, head_cache, False))
    finally:
        stop_group(server.process)


def _seeded_venv(target: Path) -> None:
    """A venv whose path ends with this process's site-packages. Plain path
    lines: the editable install of this checkout (a .pth file there) stays
    out of it, and pip leaves what it finds there alone."""
    venv.EnvBuilder(with_pip=True).create(target)
    (seed,) = (target / "lib").glob("python*/site-packages")
    (seed / "node-image.pth").write_text("\n".join(site.getsitepackages()) + "\n")


def _file_mounts(target: Path) -> None:
    """What `ray up` syncs to `~/disagg` on each node: the project as git lists
    it (tracked and new files; .venv, caches and checkpoints are ignored, as
    the YAMLs' rsync_exclude has it)."""
    listing = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    )
    for name in filter(None, listing.stdout.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def test_ray_up_setup_then_the_readme_command_serves_on_the_cluster(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    """The on-premise YAML's setup on a scratch home, then its README command
    (on loopback) joins the module's cluster with `address: auto`.

    The node's venv starts out seeing this process's packages (a node image
    with the dependencies in place), so the setup runs every command, installs
    the project, the default model and the checkpoint, and leaves the
    dependencies as they are: installing them from nothing takes minutes, and
    `make install` on a clean clone does that on every CI run."""
    home = tmp_path / "home"
    _file_mounts(home / "disagg")
    _seeded_venv(home / "disagg" / ".venv")
    real_home = Path.home()
    env = {
        **os.environ,
        **ray_cluster.env,
        "HOME": str(home),
        # Wheels come from this machine's pip cache, and a pyenv Python's
        # shims find their root from HOME.
        "PIP_CACHE_DIR": os.environ.get("PIP_CACHE_DIR", str(real_home / ".cache" / "pip")),
        "PYENV_ROOT": os.environ.get("PYENV_ROOT", str(real_home / ".pyenv")),
    }
    for command in yaml.safe_load(ONPREM_YAML.read_text())["setup_commands"]:
        done = subprocess.run(
            ["bash", "-c", command], env=env, capture_output=True, text=True, timeout=900
        )
        assert done.returncode == 0, f"{command}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    readme = (ROOT / "README.md").read_text()
    exec_command = re.search(r"ray exec deploy/ray/cluster-onprem.yaml '([^']+)'", readme)
    assert exec_command, "the README names no serve command for the on-premise cluster"
    command = f"{exec_command.group(1)} --host 127.0.0.1 --port 0"  # loopback in tests
    server = start_serve_command(["bash", "-c", command], home, env)
    try:
        _check_greedy_completions(server, home / "disagg" / "checkpoints" / "tiny-llama")
    finally:
        stop_group(server.process)


def test_an_instance_whose_node_dies_restarts_from_a_checked_copy_that_the_next_start_reuses(
    ray_cluster: RayCluster,
    checkpoints: dict[str, Path],
    tmp_path: Path,
) -> None:
    """Ray restarts the instance of a dead node on a node without the
    checkpoint's folder: it copies the files there (each file's size and
    sha256 checked) and serves the same tokens; the next `disagg serve`
    loads that node's copy as it is."""
    checkpoint = checkpoints["llama"]
    first = start_node(ray_cluster, MOVING_NODES[0], 1, {"moving": 1})
    config = _config(tmp_path, ray_cluster, "python", generation_resource="moving")
    copy = tmp_path / "second-node-checkpoints"
    copied = copy / manifest_of(checkpoint).digest / checkpoint.name
    server = start_serve(config, checkpoint, ray_cluster.env)
    try:
        output = "".join(server.output)
        assert f"generation-0 on {MOVING_NODES[0]}" in output, output
        _check_greedy_completions(server, checkpoint)
        hidden = checkpoint.parent
        start_node(ray_cluster, MOVING_NODES[1], 1, {"moving": 1}, hidden, {CACHE_ENV: str(copy)})
        first.stop(signal.SIGKILL)
        deadline = time.monotonic() + 240
        while not copied.is_dir():  # the restarted worker's copy is in place
            assert time.monotonic() < deadline, "".join(server.output)
            time.sleep(1)
        while _health(server)["healthy_workers"] != {"context": 1, "generation": 1}:
            assert time.monotonic() < deadline, _health(server)
            time.sleep(1)
        _check_greedy_completions(server, checkpoint)
        output = "".join(server.output)
        assert "generation-0: copying llama" in output, output
        assert "generation-0: copied llama, every file's size and sha256 checked" in output
        # The restarted worker listens on its new node's address.
        assert _listening_addresses(ray_cluster, "GenerationWorker") == {MOVING_NODES[1]}
    finally:
        stop_group(server.process)
    assert manifest_of(copied) == manifest_of(checkpoint)
    server = start_serve(config, checkpoint, ray_cluster.env)
    try:
        output = "".join(server.output)
        assert f"generation-0 on {MOVING_NODES[1]}" in output, output
        assert f"generation-0: using this node's copy of llama at {copied}" in output, output
        assert "copying" not in output
        _check_greedy_completions(server, checkpoint)
    finally:
        stop_group(server.process)


def _health(server: ServeProcess) -> dict[str, object]:
    return dict(httpx.get(server.base + "/health", timeout=30).json())


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


def test_llama_on_python_across_nodes_then_a_lost_generation_node_fails_only_its_streams(
    ray_cluster: RayCluster, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Two generation instances on two nodes serve transformers' tokens, the
    cache listeners bound to their node's address; then one node is killed
    mid-stream: its streams end with an error naming it, the others finish,
    and the survivors serve on. Runs last: it kills one of the module
    cluster's nodes."""
    checkpoint = checkpoints["llama"]
    config = _config(tmp_path, ray_cluster, "python", num_generation=2, cache_tokens=4096)
    server = start_serve(config, checkpoint, ray_cluster.env)
    try:
        _check_placed_and_serving(server, checkpoint)
        # The cache listeners bind to their node, not 0.0.0.0.
        assert _listening_addresses(ray_cluster, "ContextWorker") == {PREFILL_NODE}
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

        deadline = time.monotonic() + 120
        while _health(server)["healthy_workers"] != {"context": 1, "generation": 1}:
            assert time.monotonic() < deadline, _health(server)
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
