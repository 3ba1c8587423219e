"""A generation worker's event stream over a TCP socket of its own.

The router reads each generation worker's events (`engine.event_stream`,
one message per engine step) on one long-lived stream. A Ray streaming call
carrying them cost several times the CPU per message, on both sides, that
the same messages framed on a socket cost: at a few hundred decode steps
per second, a third of a core on each side, taken from the engine's compute
threads (docs/performance.md, "Serving path").

So the Ray call only opens the stream: `GenerationWorker.event_socket`
yields one `EventSocketOffer` (the worker's incarnation, where its listener
is, a one-time ticket), and the events follow on a connection to that
listener that presents the ticket. The call stays open, yielding nothing
more, until the stream ends; Ray reports the worker's death on it, which a
closed socket alone does not tell.

The router sends its requests the other way on the same connection: a
frame holding a list of `GenerationRequest`s (what `submit_many` takes),
which the worker answers with a frame holding their `SubmitReceipt`, in the
order sent, among the event batches. A Ray call per burst waited on Ray's
threads for a tenth of a disaggregated request's time to first token
(docs/performance.md); a frame on the open connection does not.

A context worker takes the router's `prefill` calls on such a socket
(`ContextWorker.call_socket`, `serve_calls`): a frame `(call id, request)`
starts a call, `(call id, None)` cancels it, and the worker answers each
with `(call id, True, result)` or `(call id, False, exception)`. A Ray call
each way to a busy context worker (its dispatch and its return) took a few
times what a frame on the socket takes, an eighth of a 1P1D request's time
to its first token (docs/performance.md).

The listener binds the worker's node address (`ray.util.get_node_ip_address`),
on a port the OS picks: the router's node must reach the workers' nodes
on any TCP port, as Ray's own worker-to-worker calls do. A
connection that does not present a ticket the worker issued within
`TICKET_TIMEOUT_S` is closed unanswered, so only the caller of
`event_socket` reads a worker's events. Frames are pickled, as Ray's own
messages are: the reader trusts the worker it connected to through Ray, and
the worker reads requests only from the connection that presented its
ticket.

    frame = length (4 bytes, big-endian) | pickle of a list of events
            (or, router to worker, of a list of requests; worker to
            router, of the receipt that answers them; or a call's tuple)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import pickle
import secrets
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

TICKET_BYTES = 32
# How long a connection has to present its ticket, and an offer to be taken up.
TICKET_TIMEOUT_S = 10.0
OFFER_TIMEOUT_S = 30.0
_LENGTH = struct.Struct("!I")

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass(frozen=True)
class EventSocketOffer:
    """Where to read a worker's events: connect to `host:port`, send `ticket`."""

    incarnation: str
    host: str
    port: int
    ticket: bytes


class EventListener:
    """A worker's listening socket; hands each connection that presents a
    ticket from `issue` to that ticket's waiter."""

    def __init__(self, host: str | None = None) -> None:
        self.host = host  # None: this Ray node's address, found at `start`
        self.port = 0
        self._server: asyncio.Server | None = None
        self._waiting: dict[bytes, asyncio.Future[Connection]] = {}

    async def start(self) -> None:
        """Listen (once; later calls do nothing)."""
        if self._server is None:
            if self.host is None:
                import ray.util

                self.host = ray.util.get_node_ip_address()
            self._server = await asyncio.start_server(self._accepted, self.host, 0)
            self.port = self._server.sockets[0].getsockname()[1]

    async def offer(self, incarnation: str) -> tuple[EventSocketOffer, asyncio.Future[Connection]]:
        """Listen if not yet, and issue a ticket: the offer a worker's Ray call
        yields, and the future the connection presenting it completes (see
        `taken_up`)."""
        await self.start()
        assert self.host is not None
        ticket, connected = self.issue()
        return EventSocketOffer(incarnation, self.host, self.port, ticket), connected

    def issue(self) -> tuple[bytes, asyncio.Future[Connection]]:
        """A new ticket, and the future its connection will complete."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        connected: asyncio.Future[Connection] = asyncio.get_running_loop().create_future()
        self._waiting[ticket] = connected
        connected.add_done_callback(lambda _: self._waiting.pop(ticket, None))
        return ticket, connected

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(TICKET_TIMEOUT_S):
                ticket = await reader.readexactly(TICKET_BYTES)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            ticket = b""
        connected = self._waiting.pop(ticket, None)
        if connected is None or connected.done():
            writer.close()
            return
        connected.set_result((reader, writer))

    async def close(self) -> None:
        for connected in list(self._waiting.values()):
            connected.cancel()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None


async def taken_up(connected: asyncio.Future[Connection]) -> Connection | None:
    """The connection that took an offer up, or None when none came within
    `OFFER_TIMEOUT_S`."""
    try:
        async with asyncio.timeout(OFFER_TIMEOUT_S):
            return await connected
    except TimeoutError:
        return None


def frame(batch: Any) -> bytes:
    data = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next frame's object; `asyncio.IncompleteReadError` at the end."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    return pickle.loads(await reader.readexactly(length))


async def serve_calls(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    handler: Callable[[Any], Awaitable[Any]],
) -> None:
    """Answer the calls that arrive on a connection: each `(call id, arg)`
    frame runs `handler(arg)` as its own task and is answered by `(call id,
    True, result)` or `(call id, False, exception)`; `(call id, None)`
    cancels that call (it is not answered). When the caller closes its end,
    the calls still running are cancelled, as Ray cancels the calls of a
    caller that went away."""
    running: dict[int, asyncio.Task[Any]] = {}

    def answer(call_id: int, task: asyncio.Task[Any]) -> None:
        running.pop(call_id, None)
        if task.cancelled() or writer.is_closing():
            return
        error = task.exception()
        reply = (call_id, True, task.result()) if error is None else (call_id, False, error)
        try:
            data = frame(reply)
        except Exception as exc:  # an answer that does not pickle
            logger.warning("the answer to call %d does not pickle: %s", call_id, exc)
            what = f"{type(error).__name__}: {error}" if error is not None else "its result"
            data = frame((call_id, False, RuntimeError(f"cannot send {what} ({exc})")))
        writer.write(data)

    try:
        while True:
            try:
                call_id, arg = await read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if arg is None:
                if call_id in running:
                    running[call_id].cancel()
                continue
            task = asyncio.ensure_future(handler(arg))
            running[call_id] = task
            task.add_done_callback(functools.partial(answer, call_id))
    finally:
        calls = list(running.values())
        for task in calls:
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
