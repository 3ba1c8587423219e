"""The router's end of a socket a worker offers (`engine.event_socket`).

A worker's Ray streaming call (`event_socket` of a generation worker,
`call_socket` of a context worker) yields one `EventSocketOffer` and stays
open; the router connects, presents the offer's ticket, and from then on
the two talk in frames on that connection. The call stays open for Ray's
news of the worker's death, which a closed socket alone does not tell: the
news aborts the connection at once, and a socket that closes without it
waits up to `_DEATH_NEWS_S` for it (`WorkerSocket.frames`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.event_socket import EventSocketOffer, frame, read_frame

# After a socket closed, how long Ray's word on the worker is awaited: a
# killed process closes its socket at once, Ray reports it within a second.
_DEATH_NEWS_S = 2.0


class StreamBrokenError(ConnectionError):
    """A worker's socket (or event stream) ended without an error of its own."""


@dataclass
class WorkerSocket:
    """An open connection to a worker's socket, and the Ray call that offered it."""

    offer: EventSocketOffer
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    watch: asyncio.Future[None]  # ends with the offering call; raises a death

    def send(self, message: Any) -> None:
        """Write one frame to the worker (buffered: a closed socket drops it)."""
        self.writer.write(frame(message))

    async def frames(self) -> AsyncGenerator[Any, None]:
        """Each frame from the worker until the socket closes; then raises
        Ray's news of the worker's death if it comes within `_DEATH_NEWS_S`,
        else `StreamBrokenError`."""
        while True:
            try:
                item = await read_frame(self.reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            yield item
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_DEATH_NEWS_S):
                await asyncio.shield(self.watch)  # raises a death
        raise StreamBrokenError(f"the socket of {self.offer.host}:{self.offer.port} closed")


@contextlib.asynccontextmanager
async def open_worker_socket(call: Any, role: str) -> AsyncIterator[WorkerSocket]:
    """Connect to the socket the Ray streaming call `call` offers (of a
    `role` worker) and present its ticket. Raises the call's error (a dead
    actor's) or `StreamBrokenError` when no socket can be reached."""
    try:
        offered = await anext(call)
    except StopAsyncIteration:
        raise StreamBrokenError(
            f"the {role} worker ended its call before offering a socket"
        ) from None
    offer: EventSocketOffer = await offered
    try:
        reader, writer = await asyncio.open_connection(offer.host, offer.port)
    except OSError as exc:
        raise StreamBrokenError(
            f"cannot reach the {role} worker's socket at {offer.host}:{offer.port} ({exc}); "
            f"the router's node must reach the {role} workers' nodes on any TCP port"
        ) from exc
    watch = asyncio.ensure_future(_until_ended(call))

    def abort_on_death(watched: asyncio.Future[None]) -> None:
        if not watched.cancelled() and watched.exception() is not None:
            writer.transport.abort()  # Ray's news ends the read at once

    watch.add_done_callback(abort_on_death)
    try:
        writer.write(offer.ticket)
        yield WorkerSocket(offer, reader, writer, watch)
    finally:
        watch.cancel()
        writer.close()


async def _until_ended(call: Any) -> None:
    """Wait for a Ray streaming call to end; raises its error (a dead actor's)."""
    async for ref in call:
        await ref  # the worker yields nothing after its offer
