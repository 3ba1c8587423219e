"""Build the transceiver a worker's resolved `cache_transceiver.backend` names."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from transfer.base import Transceiver

BACKENDS = ("python", "nixl")


def create_transceiver(
    backend: str,
    buffers: Mapping[str, torch.Tensor],
    *,
    secret: bytes,
    host: str = "127.0.0.1",
    max_inflight_bytes: int = 256 << 20,
) -> Transceiver:
    """A not-yet-started transceiver over the worker's pool buffers (`CacheTensors.buffers()`).

    backend: "python" or "nixl", already resolved (never "auto").
    secret: shared by the cluster; the Python backend refuses peers without it.
    host: this node's address, where the Python backend listens and is reached.
    Call `await xcvr.start()` on the worker's event loop before use.
    """
    if backend == "python":
        from transfer.python_transceiver import PythonTransceiver

        return PythonTransceiver(buffers, secret, host=host, max_inflight_bytes=max_inflight_bytes)
    if backend == "nixl":
        from transfer.nixl_transceiver import NixlTransceiver, nixl_available

        if not nixl_available():
            raise ValueError(
                "cache_transceiver.backend is 'nixl' but nixl is not importable here; "
                "install nixl or use backend 'python'"
            )
        return NixlTransceiver(buffers)
    raise ValueError(
        f"cache_transceiver.backend must be resolved to one of {BACKENDS} before a worker "
        f"starts, got {backend!r}"
    )
