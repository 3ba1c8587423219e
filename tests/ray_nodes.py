"""Ray nodes started with `ray start`, each at its own loopback address.

Every node runs `ray start --block` in a process group of its own, so a test
stops exactly the processes it started (by group and by the recorded
descendants), never with a broad `ray stop`: other Ray clusters may run on the
same machine. Each cluster keeps its records (`ray_current_cluster`, session
folders) under a private RAY_TMPDIR for the same reason.

The addresses are 127.0.0.2 and up: a node given 127.0.0.1 would advertise
the machine's external interface instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

START_TIMEOUT_S = 120
# Each node's workers take their Ray RPC ports from a range of their own (the
# nodes share one machine), so a test can tell Ray's listeners from ours.
WORKER_PORTS_PER_NODE = 200
FIRST_WORKER_PORT = 21000


# The head's health checks of the nodes, once a second (Ray's default: every
# 3 s): a killed node is found dead after five failed checks, about 5 s
# instead of 15, and a check still waits up to Ray's 10 s for a busy node.
_HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000"}


def _ray_command() -> str:
    candidate = Path(sys.executable).with_name("ray")
    return str(candidate) if candidate.exists() else "ray"


@dataclass
class RayNode:
    ip: str
    process: subprocess.Popen[bytes]
    log: Path
    worker_ports: range
    descendants: set[int] = field(default_factory=set)

    def remember_descendants(self) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            children = psutil.Process(self.process.pid).children(recursive=True)
            self.descendants.update(c.pid for c in children)

    def stop(self, sig: int = signal.SIGKILL, timeout_s: float = 30.0) -> None:
        """Stop the node's `ray start` group and every process it spawned.

        By SIGKILL unless told otherwise: on SIGTERM `ray start --block`
        drains the node for up to 30 s first, and a test's node has nothing
        to hand over."""
        self.remember_descendants()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout_s)
        survivors = _alive(self.descendants | {self.process.pid})
        for proc in survivors:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(survivors, timeout=10)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)


@dataclass
class RayCluster:
    """A head and worker nodes under one private temp folder."""

    temp_dir: Path
    head_port: int
    nodes: list[RayNode] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.nodes[0].ip}:{self.head_port}"

    @property
    def env(self) -> dict[str, str]:
        """Environment of every process of this cluster: its own records, and
        one authentication mode on all sides (`ray start --head` turns token
        authentication on by itself when ~/.ray/auth_token exists, but nodes
        and drivers that join do not follow; the nodes listen on loopback only)."""
        return {"RAY_TMPDIR": str(self.temp_dir), "RAY_AUTH_MODE": "disabled", **_HEALTH_CHECKS}

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()
        self.nodes.clear()


def free_port(ip: str) -> int:
    with socket.socket() as sock:
        sock.bind((ip, 0))
        return int(sock.getsockname()[1])


def new_cluster() -> RayCluster:
    # Short path: Ray's Unix sockets live under it and have a length limit.
    temp_dir = Path(tempfile.mkdtemp(prefix="rn", dir="/tmp"))
    return RayCluster(temp_dir, free_port("127.0.0.2"))


def start_node(
    cluster: RayCluster,
    ip: str,
    num_cpus: int,
    resources: dict[str, float] | None = None,
    hidden: Path | None = None,
    env: dict[str, str] | None = None,
) -> RayNode:
    """Start the head (first call) or a worker node at `ip`; return once it is
    registered in the cluster.

    With `hidden`, the node runs in a mount namespace of its own (`unshare`,
    unprivileged) where an empty tmpfs covers that folder: a machine without
    the files under it. `env` is added to the node's environment (its
    workers inherit it).
    """
    head = not cluster.nodes
    args = [_ray_command(), "start", "--block", "--disable-usage-stats"]
    args += ["--node-ip-address", ip, "--num-cpus", str(num_cpus), "--num-gpus", "0"]
    first = FIRST_WORKER_PORT + WORKER_PORTS_PER_NODE * int(ip.rsplit(".", 1)[1])
    ports = range(first, first + WORKER_PORTS_PER_NODE)
    args += ["--min-worker-port", str(ports.start), "--max-worker-port", str(ports.stop - 1)]
    if resources:
        args += ["--resources", json.dumps(resources)]
    if head:
        args += ["--head", "--port", str(cluster.head_port), "--include-dashboard", "false"]
    else:
        args += ["--address", cluster.address]
    if hidden is not None:
        mount = 'mount -t tmpfs tmpfs "$0" && exec "$@"'
        unshare = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount]
        args = [*unshare, str(hidden), *args]
    log = cluster.temp_dir / f"node-{ip}.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            args,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, **cluster.env, **(env or {})},
            start_new_session=True,
        )
    node = RayNode(ip, process, log, ports)
    cluster.nodes.append(node)
    _wait_registered(cluster, node)
    node.remember_descendants()
    return node


def _wait_registered(cluster: RayCluster, node: RayNode) -> None:
    """Wait until the node's raylet runs and `ray start` reports success."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if node.process.poll() is not None:
            break
        node.remember_descendants()
        if _has_raylet(node) and b"Ray runtime started" in node.log.read_bytes():
            return
        time.sleep(0.5)
    text = node.log.read_text(errors="replace")[-3000:]
    cluster.stop()
    raise AssertionError(f"ray start at {node.ip} did not come up:\n{text}")


def _has_raylet(node: RayNode) -> bool:
    for pid in node.descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            if "raylet" in psutil.Process(pid).name():
                return True
    return False


def _alive(pids: set[int]) -> list[psutil.Process]:
    alive = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
    return alive


def remove_cluster_files(cluster: RayCluster) -> None:
    shutil.rmtree(cluster.temp_dir, ignore_errors=True)
