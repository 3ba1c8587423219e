"""Which wire a Python transceiver speaks: `cache_transceiver.wire` resolved on
the worker ("tcp", "ucx" or "auto"), and the wire of a resolved kind built."""

from __future__ import annotations

import logging

from transfer.python.connection import TCP, UCX, WIRES, Wire
from transfer.python.ucx_wire import UCX_INSTALL_HINT

logger = logging.getLogger(__name__)

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
