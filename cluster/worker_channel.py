"""The router's end of a generation worker's event stream.

One long-lived Ray streaming call per worker (`GenerationWorker.events`)
carries every request's new tokens, one list per engine step; the channel
splits them into per-request queues (`engine.event_stream.EventDemux`).
A Ray streaming call was chosen over a socket the worker owns: it costs
about 1 ms per step message here, an order of magnitude less than an object
per token per request, and Ray already reports a dead or restarted actor on
it, across nodes, with no port or credential of our own.

When the stream breaks (the worker died), every request open on it gets the
error, which the router turns into a retry or a final error event; the
channel then reopens the stream, which a restarted actor answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import Any

from engine.event_stream import EventDemux, read_stream
from engine.messages import TokenEvent

logger = logging.getLogger(__name__)

_REOPEN_DELAY_S = 0.2


class StreamBrokenError(ConnectionError):
    """A worker's event stream ended without an error of its own."""


class WorkerChannel:
    def __init__(self, name: str, actor: Any) -> None:
        self.name = name
        self.actor = actor  # a Ray ActorHandle of a generation worker
        self._demux = EventDemux()
        self._reader: asyncio.Task[None] | None = None

    async def stream(self, request: Any) -> AsyncGenerator[TokenEvent, None]:
        """Send `request` (a `GenerationRequest`) and yield its events up to the
        final one. Raises what broke the worker's stream or the send (e.g.
        `RayActorError`); the request is forgotten here when the caller leaves."""
        self._start()
        queue = self._demux.open(request.request_id)
        submitted = False
        try:
            await self.actor.submit.remote(request)
            submitted = True
            async for event in read_stream(queue):
                yield event
        except Exception:
            if submitted:
                # The stream broke, not necessarily the worker (the reader's
                # call can fail while Ray restarts it, after this submit reached
                # the new instance): cancel the request there if it still runs,
                # so a retry of the same id is not refused as already in flight.
                self.actor.abort.remote(request.request_id, remember=False)
            raise
        finally:
            self._demux.close(request.request_id)

    async def stop(self) -> None:
        """Stop reading; requests still open here get `StreamBrokenError`."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        self._demux.fail_all(StreamBrokenError(f"the router stopped reading {self.name}"))

    def _start(self) -> None:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_forever())

    async def _read_forever(self) -> None:
        while True:
            error: BaseException
            try:
                async for ref in self.actor.events.remote():
                    self._demux.deliver(await ref)
                error = StreamBrokenError(f"the event stream of {self.name} ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                error = exc
            if len(self._demux):
                logger.warning("event stream of %s broke: %s", self.name, error)
            self._demux.fail_all(error)
            await asyncio.sleep(_REOPEN_DELAY_S)
