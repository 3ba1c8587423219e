"""The router's end of a generation worker's event stream.

One long-lived Ray streaming call per worker (`GenerationWorker.events`)
carries every request's new tokens, one list per engine step; the channel
splits them into per-request queues (`engine.event_stream.EventDemux`).
A Ray streaming call was chosen over a socket the worker owns: it costs
about 1 ms per step message here, an order of magnitude less than an object
per token per request, and Ray already reports a dead or restarted actor on
it, across nodes, with no port or credential of our own.

When the stream breaks (the worker died), the requests open on it get the
error, which the router turns into a retry or a final error event; the
channel then reopens the stream, which a restarted actor answers. A stream
opens with the worker's incarnation (new at each restart), which `submit`
also returns, because a stream can break late: a call made while Ray
restarted the worker may fail after a request already reached the new
instance. Such a request is spared (its events wait there for the reopened
stream); every other open request fails, since its events may have been in
the broken stream. A request submitted to an incarnation that another one
has since replaced fails too: that instance is gone.

A request is sent only once the current stream has opened (said which
incarnation answers it): by then that stream reads the worker's events, and
an earlier call the router gave up on (still running on a live worker)
cannot take any of the request's events. A request waiting to be sent is
not failed by a break (none of its events can be lost: a restarting worker
answers the reopened stream); it fails if no stream opens within
`_OPEN_WAIT_S`, and the router then tries another worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import Any

from engine.event_stream import EventDemux, StreamOpened, read_stream
from engine.messages import TokenEvent

logger = logging.getLogger(__name__)

_REOPEN_DELAY_S = 0.2
_OPEN_WAIT_S = 30.0


class StreamBrokenError(ConnectionError):
    """A worker's event stream ended without an error of its own."""


class WorkerChannel:
    def __init__(self, name: str, actor: Any) -> None:
        self.name = name
        self.actor = actor  # a Ray ActorHandle of a generation worker
        self._demux = EventDemux()
        self._reader: asyncio.Task[None] | None = None
        self._submitted_to: dict[str, str] = {}  # open request id -> incarnation
        self._replaced: set[str] = set()  # incarnations a later one replaced
        self._reading: str | None = None  # the incarnation of the last stream opened
        self._opened: asyncio.Future[None] | None = None  # see _opening()
        self._waiting: set[str] = set()  # open request ids not sent yet

    async def stream(self, request: Any) -> AsyncGenerator[TokenEvent, None]:
        """Send `request` (a `GenerationRequest`) and yield its events up to the
        final one. Raises what broke the worker's stream or the send (e.g.
        `RayActorError`); the request is forgotten here when the caller leaves."""
        self._start()
        request_id = request.request_id
        queue = self._demux.open(request_id)
        submitted = False
        try:
            await self._until_open(request_id)
            incarnation = await self.actor.submit.remote(request)
            submitted = True
            if incarnation in self._replaced:
                raise StreamBrokenError(f"{self.name} restarted after it accepted the request")
            self._submitted_to[request_id] = incarnation
            async for event in read_stream(queue):
                yield event
        except Exception:
            if submitted:
                # The stream broke, not necessarily the worker (the reader's
                # call can fail while Ray restarts it, after this submit reached
                # the new instance): cancel the request there if it still runs,
                # so a retry of the same id is not refused as already in flight.
                self.actor.abort.remote(request_id, remember=False)
            raise
        finally:
            self._demux.close(request_id)
            self._submitted_to.pop(request_id, None)

    async def _until_open(self, request_id: str) -> None:
        """Wait (at most `_OPEN_WAIT_S`) for the current stream to open."""
        self._waiting.add(request_id)
        try:
            await asyncio.wait_for(asyncio.shield(self._opening()), _OPEN_WAIT_S)
        except TimeoutError:
            raise StreamBrokenError(
                f"no event stream of {self.name} opened within {_OPEN_WAIT_S:.0f} s"
            ) from None
        finally:
            self._waiting.discard(request_id)

    def _opening(self) -> asyncio.Future[None]:
        """Done once the current stream said its incarnation; fails only when
        the router stops reading first (`_closed`)."""
        if self._opened is None:
            self._opened = asyncio.get_running_loop().create_future()
        return self._opened

    def _closed(self, error: BaseException | None = None) -> None:
        """The current stream is gone: later requests wait for the next one.
        With `error` (the router stopped reading), requests waiting to be
        sent get it instead."""
        if self._opened is None:
            return
        if self._opened.done():
            self._opened = None
        elif error is not None:
            self._opened.set_exception(error)
            self._opened.exception()  # waiters raise it; none is fine too
            self._opened = None

    async def stop(self) -> None:
        """Stop reading; requests still open here get `StreamBrokenError`."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        stopped = StreamBrokenError(f"the router stopped reading {self.name}")
        self._closed(stopped)
        self._demux.fail_all(stopped)

    def _start(self) -> None:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_forever())

    async def _read_forever(self) -> None:
        while True:
            error: BaseException
            opened: str | None = None
            try:
                async for ref in self.actor.events.remote():
                    item = await ref
                    if isinstance(item, StreamOpened):
                        opened = item.incarnation
                        self._running(opened)
                        if not self._opening().done():
                            self._opening().set_result(None)
                    else:
                        self._demux.deliver(item)
                error = StreamBrokenError(f"the event stream of {self.name} ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                error = exc
            self._closed()
            if len(self._demux):
                logger.warning("event stream of %s broke: %s", self.name, error)
            self._broke(opened, error)
            await asyncio.sleep(_REOPEN_DELAY_S)

    def _broke(self, opened: str | None, error: BaseException) -> None:
        """A stream from incarnation `opened` (None: it never said) broke: fail
        every open request but those another incarnation accepted and those
        not sent yet."""

        def spared(request_id: str) -> bool:
            if request_id in self._waiting:  # not sent: none of its events were lost
                return True
            accepted_by = self._submitted_to.get(request_id)
            return opened is not None and accepted_by is not None and accepted_by != opened

        self._demux.fail([r for r in self._demux.request_ids() if not spared(r)], error)

    def _running(self, incarnation: str) -> None:
        """`incarnation` answers now: any other one is gone, with its requests."""
        seen = set(self._submitted_to.values())
        if self._reading is not None:
            seen.add(self._reading)
        self._replaced.update(seen - {incarnation})
        self._replaced.discard(incarnation)
        self._reading = incarnation
        lost = [r for r, accepted_by in self._submitted_to.items() if accepted_by != incarnation]
        self._demux.fail(lost, StreamBrokenError(f"{self.name} restarted; its requests were lost"))
