"""`disagg serve` without `address` (deploy/configs/1p1d.yaml) runs a Ray of
its own, whatever `ray start` left on the machine; that Ray listens on a
loopback address only; and SIGTERM to the command's whole process group (a
terminal's Ctrl-C, a process supervisor's stop) ends it promptly and leaves
no process behind.

Ray's own processes are in the group too and die first, so every Ray call of
the shutdown would wait out its timeout; the server must notice Ray is gone.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.ray_nodes import new_cluster, remove_cluster_files, start_node
from tests.serve_process import ROOT, ServeProcess, start_serve, stop_group

CONFIG = ROOT / "deploy" / "configs" / "1p1d.yaml"
# Stopping takes 2-3 s alone; this bound leaves twice that for a loaded
# machine and still fails the 9.8 s that Ray's driver took when it waited to
# flush task events and metrics to its dead processes (and the 45 s that
# waiting out Ray's call timeouts took before that).
STOP_BOUND_S = 6.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.embedded.writer import ensure_checkpoint

    return ensure_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", "llama", "tiny")


@pytest.fixture(scope="module")
def served_after_a_stopped_ray_start(checkpoint: Path) -> Iterator[ServeProcess]:
    """`ray start --head`, then stopped (killed, not `ray stop`ped): its record
    stays where Ray looks for a cluster to join. Then `disagg serve`."""
    foreign_ray = new_cluster()
    try:
        start_node(foreign_ray, "127.0.0.2", num_cpus=1, resources={"foreign": 1})
        foreign_ray.stop()
        record = foreign_ray.temp_dir / "ray" / "ray_current_cluster"
        assert record.exists(), "ray start left no record where serve looks"
        server = start_serve(CONFIG, checkpoint, env=foreign_ray.env)
        try:
            yield server
        finally:
            stop_group(server.process)
    finally:
        foreign_ray.stop()
        remove_cluster_files(foreign_ray)


def test_serve_starts_its_own_ray_despite_a_stopped_ray_start(
    served_after_a_stopped_ray_start: ServeProcess, checkpoint: Path
) -> None:
    # Serve must start a Ray of its own, neither joining nor failing on the record.
    reply = httpx.post(
        served_after_a_stopped_ray_start.url + "/completions",
        json={"model": checkpoint.name, "prompt": "Hello", "max_tokens": 2},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text


def test_a_local_cluster_listens_on_loopback_only(
    served_after_a_stopped_ray_start: ServeProcess,
) -> None:
    """Every server of the serve process and of its Ray (GCS, raylet, agents,
    each worker's RPC server and transceiver) listens on a loopback address.

    Ray 2.60 binds its gRPC servers to the wildcard address whatever the node
    address (later releases bind them to the node address): those are allowed,
    one per Ray worker or driver process and those of the GCS, the raylet
    and the dashboard agent; any other listener must be on loopback.
    """
    server = psutil.Process(served_after_a_stopped_ray_start.process.pid)
    specific: dict[str, set[str]] = {}
    wildcards: dict[str, int] = {}
    for process in [server, *server.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            name = f"{process.name()} ({process.pid})"
            for conn in process.net_connections(kind="inet"):
                if conn.status != psutil.CONN_LISTEN:
                    continue
                if ipaddress.ip_address(conn.laddr.ip).is_unspecified:
                    wildcards[name] = wildcards.get(name, 0) + 1
                else:
                    specific.setdefault(name, set()).add(conn.laddr.ip)
    exposed = {
        name: ips
        for name, ips in specific.items()
        if not all(ipaddress.ip_address(ip).is_loopback for ip in ips)
    }
    assert not exposed, f"listening on a network address: {exposed}"
    ray_servers = ("gcs_server", "raylet", "ray::DashboardAgent")
    extra = {n: k for n, k in wildcards.items() if k > 1 and not n.startswith(ray_servers)}
    assert not extra, f"listening on every address beside Ray's RPC server: {extra}"
    assert any(name.startswith("gcs_server") for name in wildcards), (specific, wildcards)


def test_sigterm_to_the_process_group_stops_everything_promptly(
    served_after_a_stopped_ray_start: ServeProcess,
) -> None:
    """Runs last: it stops the module's server."""
    server = served_after_a_stopped_ray_start
    group = server.process.pid
    members = {p for p in psutil.process_iter() if _in_group(p, group)}
    members |= set(psutil.Process(group).children(recursive=True))
    try:
        started = time.monotonic()
        os.killpg(group, signal.SIGTERM)
        server.process.wait(STOP_BOUND_S * 2)
        took = time.monotonic() - started
        print(f"disagg serve stopped {took:.1f}s after SIGTERM to its process group")
        _, alive = psutil.wait_procs(list(members), timeout=5)
        assert not alive, f"left behind: {[p.pid for p in alive]}"
        assert took < STOP_BOUND_S, f"stopping took {took:.1f}s"
    finally:
        stop_group(server.process)
        for proc in members:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()


def _in_group(proc: psutil.Process, group: int) -> bool:
    try:
        return os.getpgid(proc.pid) == group
    except (ProcessLookupError, psutil.NoSuchProcess):
        return False
