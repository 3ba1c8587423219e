"""Build the transceiver a worker's resolved `cache_transceiver` settings name,
and the wire its Python transceiver speaks."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from transfer.base import Transceiver
from transfer.python.connection import TCP, UCX, WIRES, Wire
from transfer.python.ucx_wire import UCX_INSTALL_HINT

logger = logging.getLogger(__name__)

BACKENDS = ("python", "nixl")
AUTO = "auto"
WIRE_CHOICES = (TCP, UCX, AUTO)


class WireUnavailable(ValueError):
    """`cache_transceiver.wire` names a wire this machine cannot run."""


def wire_unusable_reason(wire: str) -> str | None:
    """None if this process can speak `wire`; else why not and what to install.

    UCX counts as usable when the `ucxx` package imports; a UCX context that
    then fails to start surfaces as a connection error of the transfer.
    """
    if wire == TCP:
        return None
    if wire != UCX:
        return f"unknown wire {wire!r}; known wires: {', '.join(WIRES)}"
    from transfer.python.ucx_wire import import_ucxx

    try:
        import_ucxx()
    except (ImportError, OSError) as exc:
        return f"the ucxx package cannot be imported ({exc}); install it with {UCX_INSTALL_HINT}"
    return None


def resolve_wire(requested: str) -> str:
    """This worker's `cache_transceiver.wire`: "tcp" or "ucx".

    "tcp" and "ucx" stay as asked ("ucx" raises `WireUnavailable` naming the
    package to install when `ucxx` cannot be imported here). "auto" is "ucx"
    when `ucxx` imports on this machine, else "tcp". Resolved on the worker,
    because what imports is a property of the worker's node; an "auto" choice
    is logged (as a warning, so workers show it) once per transceiver, which is
    once per worker.
    """
    if requested not in WIRE_CHOICES:
        raise WireUnavailable(
            f"cache_transceiver.wire must be one of {WIRE_CHOICES}, got {requested!r}"
        )
    if requested == TCP:
        return TCP
    reason = wire_unusable_reason(UCX)
    if requested == UCX:
        if reason is not None:
            raise WireUnavailable(f"cache_transceiver.wire is 'ucx' but {reason}")
        logger.info("cache_transceiver.wire: 'ucx'")
        return UCX
    chosen = TCP if reason is not None else UCX
    # A warning, not info: workers run at the default WARNING level, and an
    # `auto` that resolves differently from node to node must be visible.
    logger.warning(
        "cache_transceiver.wire auto -> %r (%s)", chosen, reason or "ucxx imports on this worker"
    )
    return chosen


def create_wire(name: str) -> Wire:
    """A wire of a resolved kind ("tcp" or "ucx"); the UCX one imports `ucxx` on first use."""
    if name == TCP:
        from transfer.python.tcp_wire import TcpWire

        return TcpWire()
    if name == UCX:
        from transfer.python.ucx_wire import UcxWire

        return UcxWire()
    raise WireUnavailable(f"wire must be resolved to one of {WIRES}, got {name!r}")


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
