"""The generation-phase actor (and the aggregated one).

`GenerationWorker.submit` takes a `GenerationRequest`; the events of all
requests leave through one stream, `events()`, one list per engine step
(`engine.event_stream`), which the router reads and splits per request.
With a context result attached the worker allocates blocks (and a Mamba
slot), pulls the prompt's cache through the transceiver in its own task —
the running batch keeps stepping meanwhile — and then joins the running
batch; the request's events start with one `cache_ready` event (no tokens)
as it joins the batch (its cache complete), then the *second* token (the first one came with
the `ContextResult`). Without one it runs the whole request locally
(aggregated mode and conditional disaggregation) and streams from the first
token.

Chunk-pipelined transfer: `prefetch` (sent by the router when the prompt is
longer than a context prefill chunk) starts the pull while the context
worker still prefills: blocks of finished chunks move as they are offered,
the rest and the Mamba state as soon as the prompt is published. The
`submit` that brings the `ContextResult` then joins that pull; a prefetch
that could not finish (a preemption on the context side, no room here,
nothing offered in time) frees its blocks and the submit pulls as usual.

Run as a Ray actor: `ray.remote(GenerationWorker).options(num_cpus=...).remote(config, id, role)`;
iterate `actor.events.remote()` as a streaming generator once, and send
requests with `actor.submit.remote(req)`, or several in one call with
`actor.submit_many.remote(reqs)`. An actor Ray restarts after a crash is
rebuilt from the same arguments and starts itself on its first call; it has
a new incarnation id, which its streams open with and `submit` (or
`submit_many`'s receipt) returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from decode_worker.prefetch import Prefetches
from engine.aborts import AbortedIds
from engine.errors import RequestFailedError
from engine.event_stream import EventDemux, EventOutbox, StreamOpened, read_stream
from engine.instance import EngineInstance
from engine.messages import (
    ContextResult,
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
from kvcache.layout import RequestRegions

logger = logging.getLogger(__name__)

T = TypeVar("T")

# While blocks for a pull are short, retry the allocation this often.
_ALLOC_RETRY_S = 0.005


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
        self._pulls: dict[str, asyncio.Task[bool]] = {}
        self._prefetches = (
            Prefetches(self.engine, self.transceiver, config.transfer_timeout_s)
            if self.transceiver is not None
            else None
        )
        self._admitting: set[asyncio.Task[None]] = set()  # pull, then join the batch
        self._active: set[str] = set()  # ids between submit() and their final event
        self._aborted = AbortedIds()  # aborts that arrived before their submit()
        self._outbox = EventOutbox()
        self.engine.loop.on_events = self._post
        self._local = EventDemux()  # generate()'s own reading of events()
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
            self._outbox.post([_error(req, reason, reason="abort")])
            return None
        self._active.add(rid)
        if request.context is None:
            self.engine.loop.submit(req)
        elif self.transceiver is None:
            self._post([_error(req, "this worker runs aggregated and cannot pull a cache")])
        else:
            # The pull task is registered before this call returns, so an
            # abort from now on finds and cancels it.
            pull = self._start_pull(req, request.context)
            self._admitting.add(asyncio.get_running_loop().create_task(self._admit(req, pull)))
        return None

    async def prefetch(self, request: PrefetchRequest) -> None:
        """Start pulling a prompt's cache while its context worker prefills it.

        Best effort: a `submit` with the prompt's `ContextResult` must follow
        (or an abort, which cancels the prefetch and frees its blocks).
        """
        await self.start()
        rid = request.request_id
        if (
            self._prefetches is None
            or self.config.tensor_parallel_size > 1
            or rid in self._active
            or rid in self._aborted
        ):
            return
        self._prefetches.start(request)

    async def events(self) -> AsyncIterator[StreamOpened | list[TokenEvent]]:
        """This incarnation's id, then every request's events, one list per
        engine step (or per wake-up, when the reader lags): the router's
        single stream from this worker.

        A later call takes over from an earlier one; events that find no
        reader wait for the next.
        """
        await self.start()
        batches = self._outbox.batches()  # taken over before the caller hears of it
        yield StreamOpened(self._incarnation)
        async for batch in batches:
            yield batch

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
        if self._prefetches is not None:
            self._prefetches.discard(request_id)
        if request_id not in self._active:
            if remember:
                self._aborted.add(request_id)
            return
        pull = self._pulls.pop(request_id, None)
        if pull is not None:
            if self.transceiver is not None:
                self.transceiver.abort(request_id)  # also tells the holder to free
            if self.engine.ranks is not None:
                self.engine.ranks.abort(request_id)
            pull.cancel()
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
        return await self.engine.loop.run_between_steps(
            lambda: self.engine.integrity(in_transfer, pinned)
        )

    def report(self) -> WorkerReport:
        """Load and the cache events since the last report (the router's poll)."""
        return WorkerReport(self.load(), self.engine.drain_kv_events())

    @property
    def _num_in_transfer(self) -> int:
        return len(self._pulls) + (len(self._prefetches) if self._prefetches is not None else 0)

    def step_stats(self) -> dict[str, float]:
        """The engine's step counters, and blocks pulled while their prompt prefilled."""
        pipelined = self._prefetches.num_pipelined_blocks if self._prefetches is not None else 0
        return {**self.engine.step_stats(), "pipelined_blocks": pipelined}

    def step_timeline(self) -> list[StepRecord]:
        """The engine's recent steps, oldest first (`engine.step_timeline`)."""
        return list(self.engine.loop.timeline.records)

    async def shutdown(self) -> None:
        """Cancel pulls in flight, stop the engine (open streams end with an
        error) and close the transceiver; frees everything."""
        for task in list(self._pulls.values()):
            task.cancel()
        if self._prefetches is not None:
            self._prefetches.cancel_all()
        await asyncio.gather(*self._admitting, return_exceptions=True)
        await self.engine.loop.stop()
        if self._reader is not None:
            self._reader.cancel()
        if self.transceiver is not None:
            await self.transceiver.close()
        self.engine.close()

    async def _admit(self, req: Request, pull: asyncio.Task[bool]) -> None:
        """Wait for the pull, then in one gap between steps mark the cache
        complete, announce it (`cache_ready`) and join the batch: the next
        step computes the request's next token."""
        try:
            error = await self._finish_pull(req, pull)
            if error is not None:
                self._post([error])
                return
            ready = TokenEvent(
                req.request_id, [], num_prompt_tokens=req.num_prompt_tokens, cache_ready=True
            )
            manager, unfinished = self.engine.manager, pull.result()

            def finish() -> None:
                if unfinished:  # a prefetch that placed the cache finished it already
                    manager.finish_transfer(req.request_id, req.prompt_token_ids, req.images)
                self._post([ready])

            self.engine.loop.submit(req, prefilled=True, prepare=finish)
        finally:
            self._admitting.discard(asyncio.current_task())  # type: ignore[arg-type]

    def _post(self, events: list[TokenEvent]) -> None:
        """Send events to the reader; a final one ends its request here."""
        for event in events:
            if event.finish_reason is not None:
                self._active.discard(event.request_id)
        self._outbox.post(events)

    def _start_pull(self, req: Request, context: ContextResult) -> asyncio.Task[bool]:
        """Seed `req` with the context's first token and start pulling its
        cache (or join the prefetch already pulling it)."""
        req.output_token_ids.append(context.first_token_id)
        if context.first_logprob is not None:
            req.output_logprobs.append(context.first_logprob)
        req.num_computed_tokens = req.num_prompt_tokens
        req.first_token_time = time.monotonic()
        prefetch = self._prefetches.take(req.request_id) if self._prefetches is not None else None
        pull = self._pull_into_cache(req, context, prefetch)
        task = asyncio.get_running_loop().create_task(pull)
        self._pulls[req.request_id] = task
        return task

    async def _finish_pull(self, req: Request, pull: asyncio.Task[bool]) -> TokenEvent | None:
        """Wait for the pull; on failure free what it allocated and return the
        request's final error (or abort) event."""
        rid = req.request_id
        try:
            await pull
        except (asyncio.CancelledError, Exception) as exc:
            aborted = rid not in self._pulls  # abort() took it out
            await self._between_steps(lambda: self.engine.manager.free(rid))
            if aborted:
                return _error(req, "aborted while its cache was in transfer", reason="abort")
            if isinstance(exc, asyncio.CancelledError):  # shutdown()
                return _error(req, "the worker is shutting down; retry on another worker")
            # TransferTimeout, LayoutMismatch, PeerGone, no free blocks in time
            return _error(req, f"cache transfer failed: {exc}")
        else:
            if rid not in self._pulls:  # aborted just as the pull completed
                await self._between_steps(lambda: self.engine.manager.free(rid))
                return _error(req, "aborted while its cache was in transfer", reason="abort")
        finally:
            self._pulls.pop(rid, None)
        return None

    async def _pull_into_cache(
        self, req: Request, context: ContextResult, prefetch: asyncio.Task[str | None] | None = None
    ) -> bool:
        """Place the context's cache in blocks allocated here; True when the
        caller must still mark the transfer finished (`finish_transfer`)."""
        rid, manager = req.request_id, self.engine.manager
        if prefetch is not None:
            placed = await prefetch
            if context.handle is not None and placed == context.handle.transfer_id:
                return False  # the prefetch placed this very cache, and finished it
            if placed is not None:  # another context worker's: this one is wanted
                await self._between_steps(lambda: manager.free(rid))

        def allocate() -> RequestRegions | None:
            """The pull's destination (free blocks, so beside a step); None while short."""
            if not manager.allocate_for_transfer(rid, req.num_prompt_tokens):
                return None
            return manager.regions(rid)

        handles, timeout_s = context.all_handles, self.config.transfer_timeout_s
        # The holder's answer to a claim comes while the allocation runs (or
        # waits for blocks).
        self.transceiver.claim_ahead(handles)
        try:
            regions = await self._allocate_destination(req, allocate)
        except BaseException:
            self.transceiver.abort(rid)  # drops the claims; the holder frees now
            raise
        pull = self.transceiver.pull_ranks(handles, regions, manager.layout_signature(), timeout_s)
        ranks = self.engine.ranks
        if ranks is None:
            await pull
        else:
            # Every rank pulls its own heads; a failure on one stops the others
            # (`RankGroup.pull`) before the blocks are freed.
            await _all_or_none(pull, ranks.pull(handles, regions, timeout_s))
        return True

    async def _allocate_destination(
        self, req: Request, allocate: Callable[[], RequestRegions | None]
    ) -> RequestRegions:
        """Run `allocate` until it finds room or `transfer_timeout_s` passes:
        at once, beside a step in flight, so the pull starts without waiting
        for that step to end (blocks it frees count from the next try)."""
        deadline = time.monotonic() + self.config.transfer_timeout_s
        while (regions := self.engine.loop.run_beside_step(allocate)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no free blocks for {req.num_prompt_tokens} tokens within "
                    f"{self.config.transfer_timeout_s}s; raise max_tokens on generation workers"
                )
            await asyncio.sleep(_ALLOC_RETRY_S)
        return regions

    async def _between_steps(self, fn: Callable[[], T]) -> T:
        return await self.engine.loop.run_between_steps(fn)


async def _all_or_none(*pulls: Awaitable[None]) -> None:
    """Await every pull; if one fails, wait for the others to end (each stops
    on its own failure or is aborted by the caller) before raising its error."""
    tasks = [asyncio.ensure_future(pull) for pull in pulls]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _error(req: Request, message: str, reason: str = "error") -> TokenEvent:
    return TokenEvent(
        request_id=req.request_id,
        token_ids=[],
        finish_reason=reason,
        error=f"request {req.request_id!r}: {message}",
        num_prompt_tokens=req.num_prompt_tokens,
    )
