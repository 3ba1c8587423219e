"""Build the transceiver a worker's resolved `cache_transceiver` settings name."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from transfer.base import Transceiver
from transfer.python.connection import TCP
from transfer.python.wires import resolve_wire

BACKENDS = ("python", "nixl")


def create_transceiver(
    backend: str,
    buffers: Mapping[str, torch.Tensor],
    *,
    secret: bytes,
    name: str | None = None,
    host: str = "127.0.0.1",
    max_inflight_bytes: int = 256 << 20,
    wire: str = TCP,
) -> Transceiver:
    """A not-yet-started transceiver over the worker's pool buffers (`CacheTensors.buffers()`).

    The one place a transceiver is built, for workers, benchmarks and tests.

    backend: "python" or "nixl", already resolved (never "auto").
    secret: the cluster's `cluster_secret`; the Python backend refuses an empty
        one and peers without it. NIXL agents exchange metadata through the
        router and peers are the agents named in handles, so NIXL needs none.
    name: the worker id; names the NIXL agent (a fresh unique name if None).
    host: this node's address, where the Python backend listens and is reached.
    wire: what the Python backend listens on, "tcp", "ucx" or "auto"
        (`resolve_wire`, which logs the choice once per transceiver); ignored
        by NIXL, which runs its own UCX.
    Call `await xcvr.start()` on the worker's event loop before use.
    """
    if backend == "python":
        from transfer.python.transceiver import PythonTransceiver

        if not secret:
            raise ValueError(
                "cluster_secret is empty; the Python transceiver authenticates peers with it, "
                "so every worker of the cluster needs the same non-empty secret"
            )
        return PythonTransceiver(
            buffers,
            secret,
            host=host,
            max_inflight_bytes=max_inflight_bytes,
            wire=resolve_wire(wire),
        )
    if backend == "nixl":
        from transfer.nixl.transceiver import NixlTransceiver, nixl_available

        if not nixl_available():
            raise ValueError(
                "cache_transceiver.backend is 'nixl' but nixl is not importable here; "
                "install nixl or use backend 'python'"
            )
        return NixlTransceiver(buffers, name=name)
    raise ValueError(
        f"cache_transceiver.backend must be resolved to one of {BACKENDS} before a worker "
        f"starts, got {backend!r}"
    )
