"""The UCX wire: the Python transceiver's protocol over `ucxx` endpoints.

Optional (`pip install 'disagg[ucx]'`, which pulls `ucxx-cu12`); nothing here
imports `ucxx` until a UCX listener or connection is made. Works on CPU-only
hosts. UCX picks its transports per peer among those that report a dead peer
(endpoints run with error handling, which is how a killed holder becomes
`PeerGone`): RDMA verbs, CUDA IPC, CMA, TCP. Shared-memory transports cannot,
so on a host with only loopback/Ethernet UCX runs over its own TCP transport.
`UCX_TLS` in the worker environment narrows the choice.

Every send is one UCX tag message on the endpoint's own tag, received in
order with a receive of the same size (message boundaries are kept):

    header frame, 4 + len <= SMALL_FRAME_BYTES:   [ u32 len | body ]   one message
    header frame, larger:                         [ u32 len ] [ body ] two messages
    payload:                                      one message per payload piece

The receiver takes every frame's first message into a SMALL_FRAME_BYTES
buffer and learns from `len` whether the body came with it. Payload messages
go straight from memoryviews of the pool and straight into the destination
(host memory via the buffer protocol; no copy on either side).

The process shares one UCX context (`ucxx` keeps one). It is created on the
first listener or connection with request completion signalled through a
notifier thread (the default would busy-poll a core while a receive waits),
and reset when the last user in the process closes, so no UCX thread
outlives the transceivers (a live notifier thread would block interpreter
exit).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import struct
import sys
from typing import Any

from transfer.errors import WireError
from transfer.python.connection import (
    UCX,
    Connection,
    ConnectionClosed,
    Serve,
    Wire,
    serve_then_close,
)

logger = logging.getLogger(__name__)

UCX_INSTALL_HINT = "pip install 'disagg[ucx]'"
SMALL_FRAME_BYTES = 4096
_PREFIX = struct.Struct(">I")
_users = 0  # live UcxWire objects in this process
_owns_context = False  # this module initialised the ucxx context (and resets it)
_context_options: dict[str, str] = {}  # UCX settings ucxx asked for at import


def ucx_importable() -> bool:
    """Whether the `ucxx` package is installed here (looked up, not imported)."""
    return importlib.util.find_spec("ucxx") is not None


def import_ucxx() -> Any:
    """Import `ucxx` without letting it change this process's environment.

    At import, ucxx exports UCX tuning variables (rendezvous threshold and
    rails, fragment memory type) for its own context. Left in `os.environ`
    they would also retune every other UCX user of the process (NIXL's
    agent, child processes), so they move into the options this module's
    context is created with. `UCX_MEMTYPE_CACHE`, which UCX >= 1.19 no
    longer knows, is dropped. Raises ImportError (or OSError for a broken
    native library) if ucxx is unusable.
    """
    if "ucxx" in sys.modules:
        return sys.modules["ucxx"]
    before = dict(os.environ)
    try:
        import ucxx
    finally:
        for key in [k for k in os.environ if k not in before]:
            value = os.environ.pop(key)
            if key.startswith("UCX_") and key != "UCX_MEMTYPE_CACHE":
                _context_options[key.removeprefix("UCX_")] = value
    return ucxx


class UcxConnection(Connection):
    """A connected `ucxx` endpoint; see the module docstring for the message layout."""

    wire = UCX
    keeps_message_boundaries = True

    def __init__(self, endpoint: Any, peer: str, errors: Any) -> None:
        self._ep = endpoint
        self._peer = peer
        self._errors = errors  # the `ucxx.exceptions` module
        self._frame = bytearray(SMALL_FRAME_BYTES)
        self._inline_body: bytes | None = None

    @property
    def peer(self) -> str:
        return self._peer

    async def send_frame(self, frame: bytes) -> None:
        if len(frame) <= SMALL_FRAME_BYTES:
            await self._send(frame)
            return
        view = memoryview(frame)
        await self._send(view[: _PREFIX.size])
        await self._send(view[_PREFIX.size :])

    async def recv_frame_length(self) -> int:
        await self._recv(memoryview(self._frame))
        (length,) = _PREFIX.unpack_from(self._frame)
        end = _PREFIX.size + length
        self._inline_body = (
            bytes(self._frame[_PREFIX.size : end]) if end <= len(self._frame) else None
        )
        return int(length)

    async def recv_frame_body(self, length: int) -> bytes:
        body, self._inline_body = self._inline_body, None
        if body is not None:
            return body
        buf = bytearray(length)
        await self._recv(memoryview(buf))
        return bytes(buf)

    async def send(self, data: bytes | memoryview) -> None:
        await self._send(data)

    async def recv_into(self, view: memoryview) -> None:
        await self._recv(view)

    def close(self) -> None:
        if self._ep is not None:
            ep, self._ep = self._ep, None
            ep.abort()

    async def _send(self, data: bytes | memoryview) -> None:
        await self._run(lambda ep: ep.send(data), "send")

    async def _recv(self, view: memoryview) -> None:
        await self._run(lambda ep: ep.recv(view), "receive")

    async def _run(self, op: Any, what: str) -> None:
        """Await one UCX request; map its failures onto the connection's errors.

        A cancelled caller aborts the endpoint: UCX's progress thread would
        otherwise keep reading (or writing) the pool memory of a request that
        the transceiver already considers over.
        """
        if self._ep is None:
            raise ConnectionClosed(f"{what} on a closed UCX connection to {self._peer}")
        try:
            await op(self._ep)
        except asyncio.CancelledError:
            self.close()
            raise
        except self._errors.UCXError as exc:
            self.close()
            if isinstance(exc, self._errors.UCXMessageTruncatedError):
                raise WireError(
                    f"{self._peer} sent a larger message than the protocol allows"
                ) from exc
            raise ConnectionClosed(f"UCX {what} with {self._peer} failed: {exc}") from exc


class UcxWire(Wire):
    """A UCX listener (all interfaces; `host` is what peers are told) and dialer."""

    name = UCX

    def __init__(self) -> None:
        self._ucxx: Any = None
        self._listener: Any = None
        self._conn_tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    async def listen(self, host: str, port: int, serve: Serve) -> tuple[str, int]:
        ucxx = self._context()

        async def accept(endpoint: Any) -> None:
            task = asyncio.current_task()
            if task is not None:
                self._conn_tasks.add(task)
            try:
                conn = UcxConnection(endpoint, "UCX peer", ucxx.exceptions)
                await serve_then_close(conn, serve)
            finally:
                self._conn_tasks.discard(task)  # type: ignore[arg-type]

        # ucxx binds every interface; peers are told the node's own address.
        self._listener = ucxx.create_listener(accept, port=port)
        return host, int(self._listener.port)

    async def connect(self, endpoint: tuple[str, int], timeout_s: float) -> Connection:
        ucxx = self._context()
        host, port = endpoint
        try:
            ep = await ucxx.create_endpoint(host, port, connect_timeout=timeout_s)
        except ucxx.exceptions.UCXError as exc:
            raise ConnectionError(f"UCX connect to {host}:{port} failed: {exc}") from exc
        return UcxConnection(ep, f"ucx://{host}:{port}", ucxx.exceptions)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = list(self._conn_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._ucxx is not None:
            _release_context(self._ucxx)

    def _context(self) -> Any:
        """`ucxx`, with this process's context started on the running loop."""
        if self._closed:
            raise ConnectionClosed("the UCX wire is closed")
        if self._ucxx is None:
            self._ucxx = _acquire_context()
        return self._ucxx


def _acquire_context() -> Any:
    global _users, _owns_context
    ucxx = import_ucxx()
    if _users == 0 and ucxx.core._ctx is None:
        # Must run on the event loop that awaits the requests: the notifier
        # thread resolves their futures on it.
        ucxx.init(options=_context_options, progress_mode="thread", enable_python_future=True)
        _owns_context = True
    _users += 1
    return ucxx


def _release_context(ucxx: Any) -> None:
    global _users, _owns_context
    _users -= 1
    if _users > 0 or not _owns_context:
        return
    _owns_context = False
    try:
        ucxx.reset()
    except ucxx.exceptions.UCXError as exc:  # an endpoint still referenced somewhere
        logger.warning("UCX context not reset cleanly: %s", exc)
