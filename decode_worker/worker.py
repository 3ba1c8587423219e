"""The generation-phase actor (and the aggregated one).

`GenerationWorker.submit` takes a `GenerationRequest`; the events of all
requests leave through one stream, `events()`, one list per engine step
(`engine.event_stream`), which the router reads and splits per request.
With a context result attached the worker pulls the prompt's cache first
(`decode_worker.cache_pull`) and the request's events start with one
`cache_ready` event, then the *second* token (the first one came with the
`ContextResult`). Without one it runs the whole request locally (aggregated
mode and conditional disaggregation) and streams from the first token.
`prefetch` starts such a pull while the context worker still prefills
(chunk-pipelined transfer, `decode_worker.prefetch`).

Run as a Ray actor: `ray.remote(GenerationWorker).options(num_cpus=...).remote(config, id, role)`;
read its events through `actor.event_socket.remote()` (a streaming call that
says where to connect: `engine.event_socket`) once, and send requests on
that connection (the router does), or with `actor.submit.remote(req)`, or
several in one call with `actor.submit_many.remote(reqs)`. An actor Ray
restarts after a crash is rebuilt from the same arguments and starts itself
on its first call; it has a new incarnation id, which its streams open with
and `submit` (or `submit_many`'s receipt) returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from decode_worker.cache_pull import CachePulls, error_event
from engine.aborts import AbortedIds
from engine.errors import RequestFailedError
from engine.event_socket import EventListener, EventSocketOffer, frame, read_frame, taken_up
from engine.event_stream import EventDemux, EventOutbox, StreamOpened, read_stream
from engine.instance import EngineInstance
from engine.loop import exit_for_restart
from engine.messages import (
    EventItem,
    GenerationRequest,
    PrefetchRequest,
    SubmitReceipt,
    TokenEvent,
    WorkerHealth,
    WorkerIntegrity,
    WorkerLoad,
    WorkerReport,
)
from engine.request import Request
from engine.step_timeline import StepRecord
from engine.threads import configure_torch_threads, run_on_compute_thread
from engine.worker_config import WorkerConfig

T = TypeVar("T")


class GenerationWorker:
    def __init__(
        self, config: WorkerConfig, worker_id: str = "generation-0", role: str = "generation"
    ) -> None:
        self.torch_threads = configure_torch_threads(config.device, config.cpu_affinity)
        self.config = config
        self.role = role
        self._incarnation = uuid.uuid4().hex  # a new one when Ray restarts the actor
        self.engine = run_on_compute_thread(lambda: EngineInstance.build(config, role, worker_id))
        self.transceiver: Any = self.engine.create_transceiver() if role == "generation" else None
        # Pulls disaggregated requests' caches; None where nothing can be pulled.
        self._pulls = (
            CachePulls(self.engine, self.transceiver, self._post, config.transfer_timeout_s)
            if self.transceiver is not None
            else None
        )
        self._active: set[str] = set()  # ids between submit() and their final event
        self._aborted = AbortedIds()  # aborts that arrived before their submit()
        self._outbox = EventOutbox()
        self.engine.loop.on_events = self._post
        self._local = EventDemux()  # generate()'s own reading of events()
        self._listener = EventListener()  # event_socket's; listens once asked
        self._reader: asyncio.Future[None] | None = None
        self._starting: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start the transceiver (if any) and the engine loop; idempotent (later
        calls wait for the first), and run by the first request if nobody called it."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        if self.transceiver is not None:
            await self.transceiver.start()
        self.engine.loop.on_death = exit_for_restart
        self.engine.loop.start()

    async def submit(self, request: GenerationRequest) -> str:
        """Accept a request; its events arrive on the `events()` stream of this
        incarnation (returned).

        With a context result attached the cache is pulled in the background
        and announced by a `cache_ready` event. An abort that overtook this
        call arrives there too, as a final "abort" event; an id already in
        flight here raises `RequestFailedError`.
        """
        await self.start()
        refusal = self._accept(request)
        if refusal is not None:
            raise RequestFailedError(request.request_id, refusal)
        return self._incarnation

    async def submit_many(self, requests: list[GenerationRequest]) -> SubmitReceipt:
        """`submit` for each of `requests`, in order, in one call (the router
        sends the requests waiting for this worker together). A refused
        request fails alone: the receipt says why, and the others run."""
        await self.start()
        refused: dict[str, str] = {}
        for request in requests:
            refusal = self._accept(request)
            if refusal is not None:
                refused[request.request_id] = refusal
        return SubmitReceipt(self._incarnation, refused)

    def _accept(self, request: GenerationRequest) -> str | None:
        """Start `request` here (see `submit`); why it is refused, or None."""
        rid = request.request_id
        if rid in self._active:
            return "a request with this id is already in flight here"
        req = Request(rid, list(request.prompt_token_ids), request.params, images=request.images)
        if self._aborted.take(rid):
            reason = "aborted before it reached this worker"
            self._outbox.post([error_event(req, reason, reason="abort")])
            return None
        self._active.add(rid)
        if request.context is None:
            self.engine.loop.submit(req)
        elif self._pulls is None:
            self._post([error_event(req, "this worker runs aggregated and cannot pull a cache")])
        else:
            self._pulls.admit(req, request.context)
        return None

    async def prefetch(self, request: PrefetchRequest) -> None:
        """Start pulling a prompt's cache while its context worker prefills it.

        Best effort: a `submit` with the prompt's `ContextResult` must follow
        (or an abort, which cancels the prefetch and frees its blocks).
        """
        await self.start()
        rid = request.request_id
        if (
            self._pulls is None
            or self.config.tensor_parallel_size > 1
            or rid in self._active
            or rid in self._aborted
        ):
            return
        self._pulls.prefetches.start(request)

    async def events(self) -> AsyncGenerator[StreamOpened | list[EventItem], None]:
        """This incarnation's id, then every request's events, one list per
        engine step (or per wake-up, when the reader lags): the single stream
        of events from this worker (the router reads it through `event_socket`).

        A later call takes over from an earlier one; events that find no
        reader wait for the next.
        """
        await self.start()
        batches = self._outbox.batches()  # taken over before the caller hears of it
        yield StreamOpened(self._incarnation)
        async for batch in batches:
            yield batch

    async def event_socket(self) -> AsyncIterator[EventSocketOffer]:
        """`events()` for the router, over a socket of this worker's
        (`engine.event_socket`): one offer naming this incarnation, then the
        batches go, one frame each, to the connection that presents the
        offer's ticket. The router sends its requests on that connection too,
        a `submit_many` list per frame, each answered by its `SubmitReceipt`
        in the same stream. Ends when that connection closes, when no
        connection came within `OFFER_TIMEOUT_S`, or when a later reader
        takes over."""
        stream = self.events()
        try:
            opened = await anext(stream)  # the outbox is this call's from here on
            assert isinstance(opened, StreamOpened)
            offer, connected = await self._listener.offer(opened.incarnation)
            yield offer
            connection = await taken_up(connected)
            if connection is None:
                return
            reader, writer = connection
            try:
                await _first_to_end(
                    _write_batches(stream, writer), self._answer_submits(reader, writer)
                )
            finally:
                writer.close()
        finally:
            await stream.aclose()

    async def _answer_submits(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Accept each burst of requests the router sends on its event socket
        and answer it with its receipt, until the router closes its end."""
        while True:
            try:
                requests: list[GenerationRequest] = await read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            writer.write(frame(await self.submit_many(requests)))
            await writer.drain()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """One request's events, for a caller that drives this worker alone
        (tests, offline benchmarks): it reads `events()` itself, so it must not
        share the worker with a router. Leaving early aborts the request.

        A pulled request with images may end with finish reason "preempted"
        (handed back: see `engine.scheduler`); only a router resumes it.
        """
        if self._reader is None or self._reader.done():
            self._reader = asyncio.ensure_future(self._read_locally())
        queue = self._local.open(request.request_id)
        finished = False
        try:
            await self.submit(request)
            async for event in read_stream(queue):
                finished = event.finished
                yield event
        finally:
            self._local.close(request.request_id)
            if not finished:
                self.abort(request.request_id)

    async def _read_locally(self) -> None:
        async for batch in self.events():
            if not isinstance(batch, StreamOpened):
                self._local.deliver(batch)

    def abort(self, request_id: str, remember: bool = True) -> None:
        """Cancel a request anywhere in its life; frees its blocks and slot.

        Its stream ends with a final "abort" event. An abort that arrives
        before its `submit` call (Ray does not order calls to an async
        actor) makes that call end at once with "abort"; `remember=False`
        (the caller knows `submit` ran) cancels only a request still here,
        so a later submit of the same id is not refused.
        """
        if self._pulls is not None:
            self._pulls.prefetches.discard(request_id)
        if request_id not in self._active:
            if remember:
                self._aborted.add(request_id)
            return
        if self._pulls is not None:
            self._pulls.abort(request_id)
        self.engine.loop.abort(request_id)

    def health(self) -> WorkerHealth:
        return WorkerHealth(
            worker_id=self.engine.worker_id,
            role=self.role,
            healthy=self.engine.loop.healthy,
            detail="" if self.engine.loop.healthy else "engine loop stopped",
            torch_threads=self.torch_threads,
        )

    def load(self) -> WorkerLoad:
        return self.engine.load(num_transferring=self._num_in_transfer)

    async def integrity(self) -> WorkerIntegrity:
        """Cache integrity and free blocks/slots, read between engine steps."""
        await self.start()
        pinned = self.transceiver.num_pinned if self.transceiver is not None else 0
        in_transfer = self._num_in_transfer
        return await self._between_steps(lambda: self.engine.integrity(in_transfer, pinned))

    def report(self) -> WorkerReport:
        """Load and the cache events since the last report (the router's poll)."""
        return WorkerReport(self.load(), self.engine.drain_kv_events())

    @property
    def _num_in_transfer(self) -> int:
        return self._pulls.num_in_transfer if self._pulls is not None else 0

    def step_stats(self) -> dict[str, float]:
        """The engine's step counters, and blocks pulled while their prompt prefilled."""
        pipelined = self._pulls.prefetches.num_pipelined_blocks if self._pulls is not None else 0
        return {**self.engine.step_stats(), "pipelined_blocks": pipelined}

    def step_timeline(self) -> list[StepRecord]:
        """The engine's recent steps, oldest first (`engine.step_timeline`)."""
        return self.engine.step_timeline()

    async def shutdown(self) -> None:
        """Cancel pulls in flight, stop the engine (open streams end with an
        error) and close the transceiver; frees everything."""
        if self._pulls is not None:
            await self._pulls.close()
        await self.engine.loop.stop()
        if self._reader is not None:
            self._reader.cancel()
        await self._listener.close()
        if self.transceiver is not None:
            await self.transceiver.close()
        self.engine.close()

    def _post(self, events: Sequence[EventItem]) -> None:
        """Send events to the reader; a final one ends its request here."""
        for event in events:
            if isinstance(event, TokenEvent) and event.finish_reason is not None:
                self._active.discard(event.request_id)
        self._outbox.post(events)

    async def _between_steps(self, fn: Callable[[], T]) -> T:
        return await self.engine.loop.run_between_steps(fn)


async def _write_batches(
    stream: AsyncIterator[StreamOpened | list[EventItem]], writer: asyncio.StreamWriter
) -> None:
    """Write each batch of `stream` as one frame, until it ends (a later
    reader took over) or the connection fails."""
    with contextlib.suppress(ConnectionError):
        async for batch in stream:
            writer.write(frame(batch))
            await writer.drain()


async def _first_to_end(*work: Coroutine[Any, Any, None]) -> None:
    """Run `work` until one of them returns (or raises); cancel the rest."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
