"""Token events in batches: one message per engine step, not one per token.

A worker's engine produces the new tokens of all its running requests at
each step. They leave the worker together, as one list (a `StepTokens` of
the step's plain tokens as columns, and a `TokenEvent` for each other event),
over one long-lived stream per worker; the reader splits them back into
per-request streams of `TokenEvent`s:

    engine step ──► EventOutbox.post(events) ──► batches() ──► (one Ray stream)
                                                                   │
    request queues ◄── EventDemux.deliver(batch) ◄─────────────────┘

`EventOutbox` coalesces whatever was posted since its reader last woke (one
step, or several when the reader is slower than the engine), so the number
of messages never grows with the number of requests.

A stream opens with a `StreamOpened` naming the worker's incarnation (a new
one each time Ray restarts the actor), so the reader can tell a late break of
an old instance's stream from one that took the requests' events with it.
The stream has taken over the outbox when `StreamOpened` is sent, so a
request submitted after the reader saw it has all its events on that stream
(an abandoned earlier call, still running on the worker, gets none of them).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from engine.messages import EventItem, StepTokens, TokenEvent

# What a request's queue yields: its events, or the exception that broke the
# stream they came on (the worker died); nothing follows either a final event
# or an exception.
StreamItem = TokenEvent | BaseException


@dataclass(frozen=True)
class StreamOpened:
    """The first item of a worker's event stream: the incarnation of the
    worker that answers it (`submit` returns the same id)."""

    incarnation: str


class EventOutbox:
    """A worker's outgoing token events, handed out one batch per wake-up.

    One reader at a time: `batches()` makes its caller the reader at once
    (the previous one ends at its next wake-up), and events posted while
    nobody reads wait for the next reader.
    """

    def __init__(self) -> None:
        self._events: list[EventItem] = []
        self._ready = asyncio.Event()
        self._reader = 0

    def post(self, events: Iterable[EventItem]) -> None:
        self._events.extend(events)
        if self._events:
            self._ready.set()

    def batches(self) -> AsyncIterator[list[EventItem]]:
        """Every event posted from now on (and any still waiting), in order.

        The takeover happens in this call, not at the first `anext`: an event
        posted after it can no longer go to the previous reader."""
        self._reader += 1
        self._ready.set()  # a previous reader wakes up and sees it is replaced
        return self._batches(self._reader)

    async def _batches(self, me: int) -> AsyncIterator[list[EventItem]]:
        while True:
            await self._ready.wait()
            if self._reader != me:
                return
            self._ready.clear()
            if self._events:
                batch, self._events = self._events, []
                yield batch


class EventDemux:
    """Splits batches of token events into one queue per open request.

    Events of requests nobody opened (or closed: the consumer went away) are
    dropped. A request's queue is forgotten after its final event.
    """

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[StreamItem]] = {}

    def __len__(self) -> int:
        return len(self._queues)

    def open(self, request_id: str) -> asyncio.Queue[StreamItem]:
        """The queue `request_id`'s events will arrive on; open it before the
        request is sent, so no event can come first."""
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight here")
        queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def deliver(self, batch: Iterable[EventItem]) -> None:
        queues = self._queues
        for event in batch:
            if isinstance(event, StepTokens):
                for row, request_id in enumerate(event.request_ids):
                    queue = queues.get(request_id)
                    if queue is not None:  # none of these is a final event
                        queue.put_nowait(event.event(row))
                continue
            queue = queues.get(event.request_id)
            if queue is None:
                continue
            queue.put_nowait(event)
            if event.finish_reason is not None:
                del queues[event.request_id]

    def request_ids(self) -> list[str]:
        """The requests open here."""
        return list(self._queues)

    def fail_all(self, error: BaseException) -> None:
        """End every open stream with `error` (the stream they share broke)."""
        self.fail(list(self._queues), error)

    def fail(self, request_ids: Iterable[str], error: BaseException) -> None:
        """End these requests' streams (those still open) with `error`."""
        for request_id in request_ids:
            queue = self._queues.pop(request_id, None)
            if queue is not None:
                queue.put_nowait(error)


async def read_stream(queue: asyncio.Queue[StreamItem]) -> AsyncIterator[TokenEvent]:
    """One request's events off its queue, up to and including the final one;
    raises the exception that broke the stream instead, if one arrives."""
    while True:
        item = await queue.get()
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.finish_reason is not None:
            return
