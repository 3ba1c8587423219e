"""The transports the Python transceiver's protocol runs over.

The protocol (`transfer.python.frames` header frames, the shared-secret handshake,
payload bytes) is written once against `Connection`; a `Wire` makes
connections of one kind: TCP sockets (`transfer.python.tcp_wire`, the default) or
UCX endpoints (`transfer.python.ucx_wire`, optional).

A connection carries two things, in order, in both directions:

- header frames: `u32 big-endian length + msgpack body` (built by
  `transfer.python.frames.pack_header`), sent and received whole;
- payload bytes: sent from memoryviews without copying, received straight
  into destination memory.

Byte-stream transports (TCP) do not care how the payload is cut. Message
transports (UCX tag messages) deliver each send as one message that the
receiver must take with a receive of exactly that size, so the protocol cuts
the payload the same way on both sides (`keeps_message_boundaries`): one
message per `payload_pieces` piece of each range, in range order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import ClassVar

TCP = "tcp"
UCX = "ucx"
WIRES = (TCP, UCX)
# Flow-control, staging and (on message transports) message granularity.
PAYLOAD_PIECE_BYTES = 8 << 20


class ConnectionClosed(ConnectionError):
    """The peer closed the connection (or vanished) before an operation completed."""


def payload_pieces(offset: int, length: int) -> Iterator[tuple[int, int]]:
    """(start, length) pieces of at most `PAYLOAD_PIECE_BYTES` covering a span.

    Sender and receiver cut each range with this one rule, so a message
    transport sees matching sends and receives.
    """
    end = offset + length
    for start in range(offset, end, PAYLOAD_PIECE_BYTES):
        yield start, min(PAYLOAD_PIECE_BYTES, end - start)


class Connection(ABC):
    """One link between a puller and a holder, opened by the shared-secret handshake.

    Used from one task at a time (the protocol is request/response). Every
    method raises `ConnectionClosed` (or another `ConnectionError`) when the
    peer is gone, never a transport-specific exception.
    """

    wire: ClassVar[str]
    keeps_message_boundaries: ClassVar[bool]

    @property
    @abstractmethod
    def peer(self) -> str:
        """The other end, named for logs and errors."""

    @abstractmethod
    async def send_frame(self, frame: bytes) -> None:
        """Send one whole header frame (length prefix included)."""

    @abstractmethod
    async def recv_frame_length(self) -> int:
        """Receive the next header frame's length prefix.

        The caller checks it against its limit, then calls `recv_frame_body`.
        """

    @abstractmethod
    async def recv_frame_body(self, length: int) -> bytes:
        """Receive the body of the frame whose length `recv_frame_length` returned."""

    @abstractmethod
    async def send(self, data: bytes | memoryview) -> None:
        """Send payload bytes; a memoryview is sent without copying."""

    @abstractmethod
    async def recv_into(self, view: memoryview) -> None:
        """Fill `view` completely with payload bytes."""

    async def send_views(self, views: Sequence[memoryview]) -> None:
        """Send several payload pieces in order, without copying.

        A message transport sends each view as one message (this default);
        a byte stream may send many views per system call.
        """
        for view in views:
            await self.send(view)

    async def recv_into_views(self, views: Sequence[memoryview]) -> None:
        """Fill every view completely, in order: the counterpart of `send_views`."""
        for view in views:
            await self.recv_into(view)

    @abstractmethod
    def close(self) -> None:
        """Drop the connection; idempotent. The peer sees `ConnectionClosed`."""


Serve = Callable[[Connection], Awaitable[None]]


async def serve_then_close(conn: Connection, serve: Serve) -> None:
    """Run a listener's `serve` on an accepted connection; close it however that ends."""
    try:
        await serve(conn)
    finally:
        conn.close()


class Wire(ABC):
    """Makes connections of one transport: a listener for holders, dialing for pullers."""

    name: ClassVar[str]

    @abstractmethod
    async def listen(self, host: str, port: int, serve: Serve) -> tuple[str, int]:
        """Accept connections on (host, port), each served by a task running
        `serve(connection)`; returns the (host, port) peers dial."""

    @abstractmethod
    async def connect(self, endpoint: tuple[str, int], timeout_s: float) -> Connection:
        """A new connection to a holder's listener; raises `ConnectionError` or
        `OSError` if it cannot be reached within `timeout_s`."""

    @abstractmethod
    async def close(self) -> None:
        """Stop listening and end the tasks serving accepted connections."""
