"""The TCP wire: non-blocking sockets driven by the event loop's `sock_*` methods.

`sock_sendall` hands a memoryview straight to the kernel (stream transports on
Python 3.11 would copy it into a buffer first) and `sock_recv_into` writes
straight into destination memory, so payload bytes are never copied in Python.
"""

from __future__ import annotations

import asyncio
import socket
import struct

from transfer.connection import TCP, Connection, ConnectionClosed, Serve, Wire, serve_then_close

FRAME_PREFIX = struct.Struct(">I")


def tune_socket(sock: socket.socket) -> None:
    """Non-blocking with no Nagle delay; kernel buffer sizes stay auto-tuned
    (setting SO_RCVBUF would pin the window below what Linux grows it to)."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class TcpConnection(Connection):
    """A connected non-blocking TCP socket (see `tune_socket`)."""

    wire = TCP
    keeps_message_boundaries = False

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @property
    def peer(self) -> str:
        try:
            host, port = self.sock.getpeername()[:2]
            return f"{host}:{port}"
        except OSError:
            return "unknown peer"

    async def send_frame(self, frame: bytes) -> None:
        await self.send(frame)

    async def recv_frame_length(self) -> int:
        prefix = bytearray(FRAME_PREFIX.size)
        await self.recv_into(memoryview(prefix))
        (length,) = FRAME_PREFIX.unpack(prefix)
        return int(length)

    async def recv_frame_body(self, length: int) -> bytes:
        body = bytearray(length)
        await self.recv_into(memoryview(body))
        return bytes(body)

    async def send(self, data: bytes | memoryview) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def recv_into(self, view: memoryview) -> None:
        loop = asyncio.get_running_loop()
        got, total = 0, len(view)
        while got < total:
            n = await loop.sock_recv_into(self.sock, view[got:])
            if n == 0:
                raise ConnectionClosed(f"peer closed the connection after {got} of {total} bytes")
            got += n

    def close(self) -> None:
        self.sock.close()


class TcpWire(Wire):
    """Listens on one TCP address; dials peers with fresh sockets."""

    name = TCP

    def __init__(self) -> None:
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._conn_tasks: set[asyncio.Task[None]] = set()

    async def listen(self, host: str, port: int, serve: Serve) -> tuple[str, int]:
        listener = socket.create_server((host, port), backlog=128)
        listener.setblocking(False)
        self._listener = listener
        self._accept_task = asyncio.create_task(self._accept_loop(listener, serve))
        bound_host, bound_port = listener.getsockname()[:2]
        return bound_host, bound_port

    async def connect(self, endpoint: tuple[str, int], timeout_s: float) -> Connection:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tune_socket(sock)
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.get_running_loop().sock_connect(sock, endpoint)
        except BaseException:
            sock.close()
            raise
        return TcpConnection(sock)

    async def close(self) -> None:
        tasks = [t for t in [self._accept_task, *self._conn_tasks] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()

    async def _accept_loop(self, listener: socket.socket, serve: Serve) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(listener)
            tune_socket(sock)
            task = asyncio.create_task(serve_then_close(TcpConnection(sock), serve))
            self._conn_tasks.add(task)
            task.add_done_callback(self._conn_tasks.discard)
