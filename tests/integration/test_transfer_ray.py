"""Transceivers between Ray actors: exact bytes for every manager pair, and faults.

Two long-lived actors each host a V1 and a V2 pool on both backends (and on
the Python backend's UCX wire where `ucxx` is installed: kind "ucx"); fault
tests use throw-away actors that get `ray.kill`ed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from benchmarks.transfer.endpoints import EndpointHost, EndpointSpec
from cluster.launch.launcher import init_local_ray
from kvcache.spec import CacheSpec
from transfer.python.ucx_wire import ucx_importable

ROOT = str(Path(__file__).resolve().parents[2])
HYBRID = CacheSpec(
    num_kv_heads=2,
    head_dim=16,
    attention_layers=(1, 3, 5),
    mamba_layers=(0, 2, 4),
    conv_state_shape=(24, 3),
    ssm_state_shape=(4, 8, 16),
)
BLOCK_SIZE = 8
KINDS = ["python", "nixl", *(["ucx"] if ucx_importable() else [])]
PAIRS = [
    ("ucx", "v1", "v2"),
    ("python", "v1", "v1"),
    ("python", "v2", "v2"),
    ("python", "v1", "v2"),
    ("python", "v2", "v1"),
    ("nixl", "v1", "v1"),
    ("nixl", "v2", "v2"),
]

Host = Any  # a Ray actor handle of EndpointHost


def host_specs() -> dict[str, EndpointSpec]:
    return {
        f"{kind}-{manager}": endpoint_spec(kind, manager)
        for kind in KINDS
        for manager in ("v1", "v2")
    }


def endpoint_spec(kind: str, manager: str) -> EndpointSpec:
    if kind == "ucx":  # the Python transceiver over its UCX wire
        return EndpointSpec("python", manager, HYBRID, 32, BLOCK_SIZE, wire="ucx")
    return EndpointSpec(kind, manager, HYBRID, 32, BLOCK_SIZE)


def spawn() -> Host:
    actor = ray.remote(num_cpus=0)(EndpointHost).remote(host_specs())
    ray.get(actor.start.remote())
    return actor


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Host, Host]]:
    init_local_ray(
        2,
        runtime_env={
            "env_vars": {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        },
    )
    try:
        yield spawn(), spawn()
    finally:
        ray.shutdown()


@pytest.mark.parametrize("kind,src_manager,dst_manager", PAIRS)
def test_cache_moves_exactly_between_actors(
    cluster: tuple[Host, Host], kind: str, src_manager: str, dst_manager: str
) -> None:
    if kind not in KINDS:
        pytest.skip(f"{'ucxx' if kind == 'ucx' else kind} is not importable")
    holder, puller = cluster
    src, dst = f"{kind}-{src_manager}", f"{kind}-{dst_manager}"
    rid = f"{kind}-{src_manager}-{dst_manager}"
    free_before = ray.get(holder.state.remote(src))["free_blocks"]
    num_tokens = 5 * BLOCK_SIZE - 3
    sent = ray.get(holder.fill.remote(src, rid, num_tokens, seed=len(rid)))
    handle = ray.get(holder.publish.remote(src, rid, 30.0))
    result = ray.get(puller.pull.remote(dst, handle, num_tokens, 20.0))
    assert result["ok"], result["message"]
    assert ray.get(puller.digests.remote(dst, rid)) == sent
    assert any(key.startswith("mamba/") for key in sent)
    ray.get(puller.free.remote(dst, rid))
    state = wait_state(holder, src, lambda s: rid in s["released"])
    assert state["free_blocks"] == free_before and state["pinned"] == 0


def test_nixl_refuses_a_layout_mismatch_before_moving_bytes(cluster: tuple[Host, Host]) -> None:
    if "nixl" not in KINDS:
        pytest.skip("nixl is not importable")
    holder, puller = cluster
    sent = ray.get(holder.fill.remote("nixl-v2", "mismatch", BLOCK_SIZE))
    handle = ray.get(holder.publish.remote("nixl-v2", "mismatch", 30.0))
    result = ray.get(puller.pull.remote("nixl-v1", handle, BLOCK_SIZE, 10.0))
    assert result["error"] == "LayoutMismatch"
    assert "manager" in result["message"]
    assert ray.get(holder.state.remote("nixl-v2"))["pinned"] == 1
    assert ray.get(holder.digests.remote("nixl-v2", "mismatch")) == sent
    ray.get(puller.state.remote("nixl-v1"))  # the puller freed its blocks: pool consistent
    ray.get(holder.abort.remote("nixl-v2", "mismatch"))
    assert ray.get(holder.state.remote("nixl-v2"))["pinned"] == 0


# One victim per fault test, hosting every kind: its process start is most
# of the test.
def test_killed_puller_lease_frees_holder(cluster: tuple[Host, Host]) -> None:
    holder, _ = cluster
    names = [f"{kind}-v2" for kind in KINDS]
    free_before = {name: ray.get(holder.state.remote(name))["free_blocks"] for name in names}
    victim = spawn()
    for name in names:
        ray.get(holder.fill.remote(name, f"orphan-{name}", 4 * BLOCK_SIZE))
        ray.get(holder.publish.remote(name, f"orphan-{name}", 1.0))
    kill(victim)
    for name in names:
        state = wait_state(holder, name, lambda s, n=name: f"orphan-{n}" in s["released"], 10)
        assert state["free_blocks"] == free_before[name] and state["pinned"] == 0, name


def test_killed_holder_gives_puller_peer_gone_and_it_frees(cluster: tuple[Host, Host]) -> None:
    _, puller = cluster
    names = [f"{kind}-v2" for kind in KINDS]
    free_before = {name: ray.get(puller.state.remote(name))["free_blocks"] for name in names}
    victim = spawn()
    handles = {}
    for name in names:
        ray.get(victim.fill.remote(name, f"lost-{name}", 4 * BLOCK_SIZE))
        handles[name] = ray.get(victim.publish.remote(name, f"lost-{name}", 30.0))
    kill(victim)
    for name in names:
        result = ray.get(puller.pull.remote(name, handles[name], 4 * BLOCK_SIZE, 5.0))
        assert result["error"] == "PeerGone", (name, result)
        assert result["seconds"] < 5.0, (name, result)
        assert ray.get(puller.state.remote(name))["free_blocks"] == free_before[name], name


def kill(actor: Host) -> None:
    """`ray.kill` and wait until the process is really gone (kill is asynchronous)."""
    pid = ray.get(actor.pid.remote())
    ray.kill(actor)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"actor process {pid} still alive after ray.kill")


def wait_state(host: Host, name: str, done: Any, timeout_s: float = 5.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        state = ray.get(host.state.remote(name))
        if done(state) or time.monotonic() > deadline:
            return state
        time.sleep(0.05)
