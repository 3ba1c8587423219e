"""The router's end of a generation worker's event stream.

One long-lived stream per worker carries every request's new tokens, one
list per engine step; the channel splits them into per-request queues
(`engine.event_stream.EventDemux`). The stream runs on a socket the worker
owns, opened and watched through a Ray streaming call
(`GenerationWorker.event_socket`, `engine.event_socket`): a step message on
the socket costs a tenth of the CPU it cost as an item of the Ray call, and
the call still brings Ray's news of a dead or restarted actor, which a
closed socket alone does not tell (`read_event_socket`).

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

Requests go to the worker in bursts: one `submit_many` carries every
request waiting for it, and at most one is in flight per worker; requests
that arrive meanwhile go in the next. A request the worker refuses (an id
already in flight there) fails alone. At rate inf this sends a burst of 64
requests in a few submits instead of 64. A burst goes as a frame on the
event socket, answered by the receipt on it (`SocketOpened`); on a stream
that cannot carry it, as a Ray call. A stream that breaks while a burst
waits for its receipt fails the burst with the break, as a failed call
does, and aborts its requests on the worker in case they got there (the
worker may live on: a later reader took its stream over).

A request is sent only once the current stream has opened (said which
incarnation answers it): by then that stream reads the worker's events, and
an earlier call the router gave up on (still running on a live worker)
cannot take any of the request's events. A stream that closes while a
request waits for the next call sends it back to waiting for the next
stream. A request waiting to be sent lost none of its events when a stream
breaks, so a break alone does not fail it: it waits for the reopened stream,
at most `_OPEN_WAIT_S`. A break that says the worker died (`RayActorError`)
fails it at once with that error, so the router routes it around the worker
instead of waiting for Ray to restart it (seconds: a process, a model, a
transfer agent); a request that arrives while the worker restarts waits for
the reopened stream, also when a stream call made during the restart fails
(Ray says "temporarily unavailable", at times after the new instance has
answered the router's polls). `stop()` fails it at once. A caller that
leaves before its request went is taken out of the next call.

A worker that is alive but answers nothing (a stopped process, a blocked
event loop) breaks no stream. When the router gives up on it
(`fail_sent`), the requests it accepted or that are in a submit call to it
fail; they are aborted there, so a worker that comes back frees them (one
still in the call is aborted before it can start). Requests queued for the
next call fail too (they would wait for the hung one); requests waiting for
a stream to open keep their own wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError

from cluster.routing.worker_socket import StreamBrokenError, open_worker_socket
from engine.errors import RequestFailedError
from engine.event_stream import EventDemux, StreamOpened, read_stream
from engine.messages import EventItem, GenerationRequest, SubmitReceipt, TokenEvent
from runtime.cancellation import cancel_and_wait, stop_if_cancelled

logger = logging.getLogger(__name__)

# What a worker's event stream yields: how it opened, then event batches and
# (on a socket) the receipts of the bursts sent on it.
StreamItem = StreamOpened | list[EventItem] | SubmitReceipt

_REOPEN_DELAY_S = 0.2
_OPEN_WAIT_S = 30.0


@dataclass(frozen=True)
class SocketOpened(StreamOpened):
    """`StreamOpened` of a stream on the worker's event socket: `send`
    writes a burst of requests to the worker on it, whose `SubmitReceipt`
    comes back in the stream."""

    send: Callable[[list[GenerationRequest]], None]


class WorkerChannel:
    def __init__(
        self,
        name: str,
        actor: Any,
        open_stream: Callable[[Any], AsyncGenerator[StreamItem, None]] | None = None,
    ) -> None:
        self.name = name
        self.actor = actor  # a Ray ActorHandle of a generation worker
        # Opens one event stream from the actor: `StreamOpened`, then batches
        # (and receipts); raises what broke it (`read_event_socket`).
        self._open_stream = open_stream or read_event_socket
        self._demux = EventDemux()
        self._reader: asyncio.Task[None] | None = None
        self._submitted_to: dict[str, str] = {}  # open request id -> incarnation
        self._replaced: set[str] = set()  # incarnations a later one replaced
        self._reading: str | None = None  # the incarnation of the last stream opened
        self._opened: asyncio.Future[None] | None = None  # see _opening()
        self._waiting: set[str] = set()  # open request ids not sent yet
        # Requests for the next submit call, each with its future: the
        # incarnation that accepted it, or None (the stream closed first).
        self._outgoing: dict[str, tuple[GenerationRequest, asyncio.Future[str | None]]] = {}
        self._sender: asyncio.Task[None] | None = None  # the submit calls' loop
        self._in_call: list[tuple[GenerationRequest, asyncio.Future[str | None]]] = []
        # Where the current stream takes a burst (`SocketOpened.send`), and
        # the receipt of the burst sent there, which the reader settles.
        self._send_on_stream: Callable[[list[GenerationRequest]], None] | None = None
        self._receipt: asyncio.Future[SubmitReceipt] | None = None
        self._last_break: BaseException | None = None  # what broke the last stream

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        """Send `request` and yield its events up to the final one. Raises what
        broke the worker's stream or the send (e.g. `RayActorError`), or the
        worker's refusal (`RequestFailedError`); the request is forgotten here
        when the caller leaves."""
        self._start()
        request_id = request.request_id
        queue = self._demux.open(request_id)
        submitted = False
        try:
            incarnation = await self._send(request)
            submitted = True
            if incarnation in self._replaced:
                raise StreamBrokenError(f"{self.name} restarted after it accepted the request")
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

    async def _send(self, request: GenerationRequest) -> str:
        """Send `request` in the next submit call once the current stream has
        opened; the incarnation that accepted it (recorded in `_submitted_to`)."""
        request_id = request.request_id
        loop = asyncio.get_running_loop()
        self._waiting.add(request_id)
        try:
            while True:
                await self._until_open()
                sent: asyncio.Future[str | None] = loop.create_future()
                self._outgoing[request_id] = (request, sent)
                if self._sender is None:
                    self._sender = loop.create_task(self._send_bursts())
                try:
                    incarnation = await sent
                finally:
                    if request_id in self._outgoing and self._outgoing[request_id][1] is sent:
                        del self._outgoing[request_id]  # the caller left before the call
                if incarnation is not None:
                    return incarnation
        finally:
            self._waiting.discard(request_id)

    async def connect(self) -> None:
        """Open the event stream now, as the first request would, and wait
        (at most `_OPEN_WAIT_S`) until it has: start-up does this, so that
        no request pays for the opening. Raises `StreamBrokenError`."""
        self._start()
        await self._until_open()

    async def _until_open(self) -> None:
        """Wait (at most `_OPEN_WAIT_S`) for the current stream to open."""
        if self._opened is not None and self._opened.done():
            return
        try:
            async with asyncio.timeout(_OPEN_WAIT_S):
                await asyncio.shield(self._opening())
        except TimeoutError:
            last = f" (the last one broke: {self._last_break})" if self._last_break else ""
            raise StreamBrokenError(
                f"no event stream of {self.name} opened within {_OPEN_WAIT_S:.0f} s{last}"
            ) from None

    async def _send_bursts(self) -> None:
        """Send the requests waiting in `_outgoing`, all in one submit call, and
        again those that arrived during it, until none waits."""
        try:
            while self._outgoing:
                # A future already done: its caller left (the entry goes soon).
                burst = [(r, sent) for r, sent in self._outgoing.values() if not sent.done()]
                self._outgoing.clear()
                if self._opened is None or not self._opened.done():
                    for _, sent in burst:  # the stream closed: back to waiting for the next
                        sent.set_result(None)
                elif burst:
                    for request, _ in burst:
                        self._waiting.discard(request.request_id)
                    await self._submit(burst)
        finally:
            self._sender = None

    async def _submit(
        self, burst: list[tuple[GenerationRequest, asyncio.Future[str | None]]]
    ) -> None:
        """One submit of `burst`, on the stream or as a Ray call; settles each
        request's future."""
        self._in_call = burst
        requests = [r for r, _ in burst]
        try:
            if self._send_on_stream is None:
                receipt: SubmitReceipt = await self.actor.submit_many.remote(requests)
            else:
                self._receipt = asyncio.get_running_loop().create_future()
                self._send_on_stream(requests)
                receipt = await self._receipt
        except Exception as exc:
            _fail(burst, exc)
            return
        except asyncio.CancelledError:  # stop()
            _fail(burst, self._stopped())
            raise
        finally:
            self._in_call = []
            self._receipt = None
        _settle(burst, receipt, self._submitted_to)

    def _receipt_came(self, receipt: SubmitReceipt) -> None:
        """The receipt of the burst sent on the stream: settled before the
        reader reads on, since what follows in the stream (the requests'
        events, a break) counts on knowing which requests the worker took."""
        if self._receipt is not None and not self._receipt.done():
            _settle(self._in_call, receipt, self._submitted_to)
            self._receipt.set_result(receipt)

    def fail_sent(self, error: BaseException) -> None:
        """Fail, with `error` (the worker stopped answering), every request
        the worker accepted, those in a submit call to it (both aborted
        there) and those queued behind that call, which would wait for it."""
        for request, sent in self._in_call:
            if not sent.done():
                sent.set_exception(error)
                # Remembered: the call may reach the worker after the abort.
                self.actor.abort.remote(request.request_id, remember=True)
        self._fail_outgoing(error)
        self._demux.fail(list(self._submitted_to), error)

    def _fail_outgoing(self, error: BaseException) -> None:
        """The requests queued for the next submit call get `error`."""
        _fail(list(self._outgoing.values()), error)
        self._outgoing.clear()

    def _opening(self) -> asyncio.Future[None]:
        """Done once the current stream said its incarnation; fails only when
        the router stops reading first (`_closed`)."""
        if self._opened is None:
            self._opened = asyncio.get_running_loop().create_future()
        return self._opened

    def _closed(self, error: BaseException | None = None) -> None:
        """The current stream is gone: later requests wait for the next one.
        With `error` (the worker died, or the router stopped reading), the
        requests waiting to be sent get it instead."""
        opened = self._opened
        if error is not None:
            self._fail_outgoing(error)
            if opened is not None and not opened.done():
                opened.set_exception(error)
                opened.exception()  # waiters raise it; none is fine too
            self._opened = None
        elif opened is not None and opened.done():
            self._opened = None  # else its waiters keep it for the next stream

    async def stop(self) -> None:
        """Stop reading and sending; requests still open here, sent or not,
        get `StreamBrokenError`."""
        try:
            await cancel_and_wait(self._reader, self._sender)
        finally:
            self._reader = self._sender = None
            self._send_on_stream = None
            stopped = self._stopped()
            self._closed(stopped)
            self._demux.fail_all(stopped)

    def _stopped(self) -> StreamBrokenError:
        return StreamBrokenError(f"the router stopped reading {self.name}")

    def _start(self) -> None:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_forever())

    async def _read_forever(self) -> None:
        while True:
            error: BaseException
            opened: str | None = None
            try:
                async with contextlib.aclosing(self._open_stream(self.actor)) as stream:
                    async for item in stream:
                        if isinstance(item, StreamOpened):
                            opened = item.incarnation
                            self._running(opened)
                            socket = item if isinstance(item, SocketOpened) else None
                            self._send_on_stream = socket.send if socket else None
                            if not self._opening().done():
                                self._opening().set_result(None)
                        elif isinstance(item, SubmitReceipt):
                            self._receipt_came(item)
                        else:
                            self._demux.deliver(item)
                error = StreamBrokenError(f"the event stream of {self.name} ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                error = exc
            self._last_break = error
            self._send_on_stream = None
            self._lost_receipt(error)
            self._closed(error if _says_it_died(opened, error) else None)
            if len(self._demux):
                logger.warning("event stream of %s broke: %s", self.name, error)
            self._broke(opened, error)
            stop_if_cancelled()
            await asyncio.sleep(_REOPEN_DELAY_S)

    def _lost_receipt(self, error: BaseException) -> None:
        """The stream broke before the receipt of the burst sent on it came:
        the burst fails with `error`, and its requests are aborted on the
        worker, which may have accepted them (and may live on). Nothing of the
        burst can reach the worker later, so the aborts are not remembered
        there."""
        if self._receipt is None or self._receipt.done():
            return
        self._receipt.set_exception(error)
        for request, _ in self._in_call:
            self.actor.abort.remote(request.request_id, remember=False)

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


async def read_event_socket(actor: Any) -> AsyncGenerator[StreamItem, None]:
    """One event stream of a generation worker's actor: its `SocketOpened`,
    then its batches and the receipts of the bursts sent with `send`, read
    from the worker's socket (`cluster.routing.worker_socket`). Raises what broke
    it: the Ray call's error when Ray reports the worker dead (also while the
    socket is quiet, as for a node cut off), else `StreamBrokenError` once
    the socket closed (the worker ended the stream, or died and Ray said
    nothing within `_DEATH_NEWS_S`) or could not be reached."""
    async with open_worker_socket(actor.event_socket.remote(), "generation") as socket:
        yield SocketOpened(socket.offer.incarnation, socket.send)
        async for item in socket.frames():
            yield item


def _says_it_died(opened: str | None, error: BaseException) -> bool:
    """Whether the break of a stream from incarnation `opened` (None: it
    never said) is news that the worker died. A call made while Ray restarts
    the worker fails as temporarily unavailable, at times only once the new
    instance already answers other calls: the restart is under way, and the
    requests waiting for a stream wait for the next one."""
    if opened is None and isinstance(error, ActorUnavailableError):
        return False
    return isinstance(error, RayActorError)


def _fail(
    burst: list[tuple[GenerationRequest, asyncio.Future[str | None]]], error: BaseException
) -> None:
    for _, sent in burst:
        if not sent.done():
            sent.set_exception(error)


def _settle(
    burst: list[tuple[GenerationRequest, asyncio.Future[str | None]]],
    receipt: SubmitReceipt,
    submitted_to: dict[str, str],
) -> None:
    """Settle each request of `burst` by the worker's `receipt`: refused, or
    accepted by its incarnation (recorded in `submitted_to` at once, as the
    reader may run before the caller resumes). Requests already settled (a
    caller that left) are skipped."""
    for request, sent in burst:
        rid = request.request_id
        if sent.done():  # the caller left; the router aborts the request
            continue
        if rid in receipt.refused:
            sent.set_exception(RequestFailedError(rid, receipt.refused[rid]))
        else:
            submitted_to[rid] = receipt.incarnation
            sent.set_result(receipt.incarnation)
