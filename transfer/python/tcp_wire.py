"""The TCP wire: non-blocking sockets driven by the event loop.

Payload bytes are never copied in Python: `sendmsg` hands memoryviews of the
pool straight to the kernel (stream transports on Python 3.11 would copy them
into a buffer first) and `recvmsg_into` writes straight into destination
memory. A payload of many pieces moves as one operation on the loop:

    send_views / recv_into_views(views)
      try the socket now; while unfinished:
        one reader (writer) callback stays registered on the socket, and each
        readiness event runs sendmsg / recvmsg_into over up to _MAX_IOV of the
        remaining views until the kernel takes or gives less than asked
      one future resolves when every view is done

so a wake-up costs one callback and a system call per few MB, not a
coroutine, a future and an epoll registration per piece. While receiving,
SO_RCVLOWAT holds wake-ups back until half a MiB (or the rest of the
payload) is queued. Header frames use the loop's `sock_*` methods.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import socket
import struct
from collections.abc import Callable, Sequence

from transfer.python.connection import (
    TCP,
    Connection,
    ConnectionClosed,
    Serve,
    Wire,
    serve_then_close,
)

FRAME_PREFIX = struct.Struct(">I")
# Buffers per sendmsg / recvmsg_into call (Linux accepts up to 1024; head
# slices of KV blocks are runs of a few KiB each).
_MAX_IOV = 1024
# SO_RCVLOWAT while a payload is received (Linux grows the receive buffer to
# hold it): the loop is woken per half MiB queued, not per arriving segment.
_RCVLOWAT_BYTES = 512 << 10


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

    async def send_views(self, views: Sequence[memoryview]) -> None:
        cursor = _ViewCursor(views)
        await self._drive(lambda: _send_some(self.sock, cursor), writable=True)

    async def recv_into_views(self, views: Sequence[memoryview]) -> None:
        cursor = _ViewCursor(views)
        lowat = 1

        def step() -> bool:
            nonlocal lowat
            if _recv_some(self.sock, cursor):
                return True
            # Be woken once this much is queued (or the peer closes), not for
            # every segment that arrives: one callback then moves a large chunk.
            want = min(cursor.remaining, _RCVLOWAT_BYTES)
            if want != lowat:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                lowat = want
            return False

        try:
            await self._drive(step, writable=False)
        finally:
            if lowat != 1:
                with contextlib.suppress(OSError):  # the socket was closed meanwhile
                    self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)

    async def _drive(self, step: Callable[[], bool], writable: bool) -> None:
        """Run `step` (non-blocking; True once finished) now, then on every
        readiness event of the socket until it finishes or raises."""
        if step():
            return
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def on_ready() -> None:
            if done.done():
                return
            try:
                if step():
                    done.set_result(None)
            except Exception as exc:
                done.set_exception(exc)

        fd = self.sock.fileno()
        if writable:
            loop.add_writer(fd, on_ready)
        else:
            loop.add_reader(fd, on_ready)
        try:
            await done
        finally:
            if writable:
                loop.remove_writer(fd)
            else:
                loop.remove_reader(fd)

    def close(self) -> None:
        self.sock.close()


class _ViewCursor:
    """How far a list of views has been sent or filled.

    `batch()` is the next views to hand to one system call (the first one
    shortened by what is already done) and their byte count; `advance(n)`
    moves past `n` bytes; `remaining` is what is left in all. A head slice of
    a large request is tens of thousands of small views, so both work from
    the views' cumulative ends rather than view by view.
    """

    def __init__(self, views: Sequence[memoryview]) -> None:
        # Byte views ("B" format): their length is their size in bytes.
        sizes = list(map(len, views))
        if 0 in sizes:
            views = [view for view in views if len(view)]
            sizes = [size for size in sizes if size]
        self._views = list(views)
        self._ends = list(itertools.accumulate(sizes))
        self._total = self._ends[-1] if self._ends else 0
        self._pos = 0  # bytes done
        self._index = 0  # the view `_pos` lies in
        self._head = self._views[0] if self._views else memoryview(b"")

    @property
    def remaining(self) -> int:
        return self._total - self._pos

    @property
    def done(self) -> bool:
        return self._index >= len(self._views)

    def batch(self) -> tuple[list[memoryview], int]:
        stop = min(self._index + _MAX_IOV, len(self._views))
        views = [self._head, *self._views[self._index + 1 : stop]]
        return views, self._ends[stop - 1] - self._pos

    def advance(self, n: int) -> None:
        self._pos += n
        self._index = bisect.bisect_right(self._ends, self._pos, lo=self._index)
        if self.done:
            self._head = memoryview(b"")
            return
        start = self._ends[self._index] - self._views[self._index].nbytes
        self._head = self._views[self._index][self._pos - start :]


def _send_some(sock: socket.socket, cursor: _ViewCursor) -> bool:
    """Send until done (True) or the kernel's buffer is full (False)."""
    while not cursor.done:
        views, want = cursor.batch()
        try:
            n = sock.sendmsg(views)
        except (BlockingIOError, InterruptedError):
            return False
        cursor.advance(n)
        if n < want:
            return False
    return True


def _recv_some(sock: socket.socket, cursor: _ViewCursor) -> bool:
    """Receive until done (True) or nothing more is queued (False)."""
    while not cursor.done:
        views, want = cursor.batch()
        try:
            n = sock.recvmsg_into(views)[0]
        except (BlockingIOError, InterruptedError):
            return False
        if n == 0:
            raise ConnectionClosed("peer closed the connection in the middle of a payload")
        cursor.advance(n)
        if n < want:
            return False
    return True


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
