"""Build the cache transceiver a worker's resolved config names."""

from __future__ import annotations

from typing import Any

from engine.worker_config import WorkerConfig


def make_transceiver(config: WorkerConfig, buffers: dict[str, Any], worker_id: str) -> Any:
    """A started-later `transfer.Transceiver` over the worker's pool buffers.

    `buffers` maps buffer names to the flat uint8 pool tensors
    (`CacheTensors.buffers()`); the transceiver registers them once.
    """
    if config.transceiver == "nixl":
        from transfer.nixl_transceiver import NixlTransceiver

        # NIXL agents exchange metadata through the router; peers are the
        # agents named in handles, so no shared secret is involved here.
        return NixlTransceiver(buffers, name=worker_id)
    secret = config.cluster_secret.encode()
    if not secret:
        raise ValueError(
            "cluster_secret is empty; the Python transceiver authenticates peers with it, "
            "so every worker of the cluster needs the same non-empty secret"
        )
    from transfer.factory import resolve_wire
    from transfer.python_transceiver import PythonTransceiver

    wire = resolve_wire(config.transfer_wire)  # logs the choice, once per worker
    return PythonTransceiver(buffers, secret, host=config.transfer_host, wire=wire)
