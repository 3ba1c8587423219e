"""The context-phase actor: prefill prompts, sample the first token, hold the
cache until the generation side pulls it.

Prompts from concurrent `prefill` calls are batched by the shared engine core
(chunked prefill). When a prompt's first token is sampled, its blocks and
Mamba slot stay allocated and are published through the transceiver with a
lease; they are freed exactly once, when the puller releases them or the
lease runs out (whichever comes first).

Chunk-pipelined transfer: a generation worker may ask `blocks_ready` while
a long prompt still prefills; it gets the blocks its finished chunks filled
(offered through the transceiver, see `prefill_worker.chunk_progress`) and,
once the prompt is published, the rest with the Mamba state.

Run as a Ray actor: `ray.remote(ContextWorker).options(num_cpus=...).remote(config, id)`;
call `prefill` through Ray, or over the socket `call_socket` offers (the
router does: `cluster.routing.context_calls`).
An actor Ray restarts after a crash is rebuilt from the same arguments and
starts itself on its first request, so the router can use it again as soon
as it answers polls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from engine.aborts import AbortedIds
from engine.core import StepResult
from engine.errors import RequestFailedError
from engine.event_socket import EventListener, EventSocketOffer, serve_calls, taken_up
from engine.event_stream import EventDemux, read_stream
from engine.instance import EngineInstance
from engine.loop import exit_for_restart
from engine.messages import (
    BlocksReady,
    ContextRequest,
    ContextResult,
    WorkerHealth,
    WorkerIntegrity,
    WorkerLoad,
    WorkerReport,
)
from engine.request import Request
from engine.step_event import HostEvent, StepEvent, wait_for
from engine.step_timeline import StepRecord
from engine.tensor_parallel import RankGroup
from engine.threads import configure_torch_threads, run_on_compute_thread
from engine.worker_config import WorkerConfig
from prefill_worker.chunk_progress import ChunkProgress

logger = logging.getLogger(__name__)


class ContextWorker:
    def __init__(self, config: WorkerConfig, worker_id: str = "context-0") -> None:
        self.torch_threads = configure_torch_threads(config.device, config.cpu_affinity)
        self.config = config
        self.engine = run_on_compute_thread(
            lambda: EngineInstance.build(config, "context", worker_id)
        )
        self.transceiver: Any = self.engine.create_transceiver()
        # Published handles by request, with the event after the writes of
        # the step that published them (a handle leaves once it is done).
        self._handles: dict[str, tuple[Any, StepEvent]] = {}
        self._step_written: StepEvent = HostEvent()  # the last step's
        # Ranks 1..'s handles of a tensor-parallel instance, being published,
        # by request; and every such publish until the ranks answered it.
        self._rank_handles: dict[str, asyncio.Task[list[Any]]] = {}
        self._rank_publishes: set[asyncio.Task[list[Any]]] = set()
        self._publish_errors: dict[str, str] = {}
        self._active: set[str] = set()  # ids between prefill() start and end
        self._aborted = AbortedIds()  # aborts that arrived before their prefill()
        self._starting: asyncio.Task[None] | None = None
        self._incarnation = uuid.uuid4().hex  # names this process in its call sockets' offers
        self._listener = EventListener()  # call_socket's; listens once asked
        # A context request ends at its first token: its one event, however
        # many prompts finished in the same step.
        self._results = EventDemux()
        self.engine.loop.on_events = self._results.deliver
        self._progress = ChunkProgress(self.engine.manager)
        self.engine.loop.on_step = self._on_step

    async def start(self) -> None:
        """Start the transceiver and the engine loop; idempotent (later calls
        wait for the first), and run by the first request if nobody called it."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        await self.transceiver.start()
        self.engine.loop.on_handoff = self._publish
        self.engine.loop.on_death = exit_for_restart
        self.engine.loop.start()

    async def prefill(self, request: ContextRequest) -> ContextResult:
        """Prefill one prompt and sample its first token.

        Raises `RequestFailedError` when the prompt cannot run here (too long
        for the cache) or was aborted.
        """
        await self.start()
        rid = request.request_id
        if self._aborted.take(rid):
            raise RequestFailedError(rid, "aborted before it reached this worker")
        req = Request(rid, list(request.prompt_token_ids), request.params, images=request.images)
        results = self._results.open(rid)
        self.engine.loop.submit(req)
        self._active.add(rid)
        try:
            event = await anext(read_stream(results))
        except asyncio.CancelledError:
            self._results.close(rid)
            self.abort(rid)
            self._end_offers(rid)
            raise
        finally:
            self._active.discard(rid)
        handle, written = self._handles.pop(request.request_id, (None, HostEvent()))
        if handle is None:
            self._end_offers(rid)
        if event.finish_reason in ("error", "abort"):
            raise RequestFailedError(request.request_id, event.error or event.finish_reason)
        if event.finish_reason == "handoff" and handle is None:
            reason = self._publish_errors.pop(request.request_id, "not published")
            raise RequestFailedError(request.request_id, f"cache could not be published: {reason}")
        await self._written(rid, written)
        rank_handles = await self._published_by_ranks(rid)
        return ContextResult(
            request_id=request.request_id,
            first_token_id=event.token_ids[0],
            first_logprob=event.logprobs[0] if event.logprobs else None,
            first_top_logprobs=event.top_logprobs[0] if event.top_logprobs else None,
            handle=handle,
            finish_reason=None if event.finish_reason == "handoff" else event.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            first_token_time=event.timestamp,
            rank_handles=tuple(rank_handles),
            draft_token_ids=tuple(event.draft_token_ids),
            samples=req.sample_starts,
        )

    async def call_socket(self) -> AsyncIterator[EventSocketOffer]:
        """`prefill` calls over a socket of this worker's
        (`engine.event_socket.serve_calls`), for a router: one offer, then the
        calls of the connection that presents its ticket are answered on it.
        Ends when that connection closes (its calls still running are
        cancelled) or when no connection came within `OFFER_TIMEOUT_S`. Each
        router opens its own."""
        await self.start()
        offer, connected = await self._listener.offer(self._incarnation)
        yield offer
        connection = await taken_up(connected)
        if connection is None:
            return
        reader, writer = connection
        try:
            await serve_calls(reader, writer, self.prefill)
        finally:
            writer.close()

    async def blocks_ready(self, request_id: str, num_pulled: int) -> BlocksReady:
        """What a puller holding the first `num_pulled` blocks of a prompt can
        pull next: offered final blocks while it prefills, the rest and the
        Mamba state once it is published, or nothing (see `BlocksReady`).

        Waits up to `transfer_timeout_s` for news; may run before `prefill`.
        """
        await self.start()
        if self.engine.ranks is not None:  # each rank's heads move after the publish
            return BlocksReady(request_id, None)
        progress = await self._progress.wait(request_id, num_pulled, self.config.transfer_timeout_s)
        await self._progress.settled(progress)  # nothing is awaited below
        layout = self.engine.manager.layout
        if progress.published is not None:
            whole = progress.published.regions
            rest = layout.request_regions(whole.block_ids[num_pulled:], whole.mamba_slot)
            handle = dataclasses.replace(progress.published, regions=rest)
            end = len(whole.block_ids)
            return BlocksReady(request_id, handle, num_pulled, end, final=True)
        if progress.ended or progress.withdrawn:
            return BlocksReady(request_id, None)
        if progress.num_ready <= num_pulled:
            if request_id not in self._active:  # never came: forget the ask
                self._progress.forget(request_id)
            return BlocksReady(request_id, None, pending=True)
        ready = layout.request_regions(progress.block_ids[num_pulled:], None)
        handle = self.transceiver.offer(request_id, ready, layout.signature())
        return BlocksReady(request_id, handle, num_pulled, progress.num_ready)

    async def _written(self, request_id: str, written: StepEvent) -> None:
        """Wait until the published cache is written on the device (a
        sampling step's writes are, by the time it published); unpin it if
        the caller goes away meanwhile."""
        try:
            await wait_for(written)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise

    async def _published_by_ranks(self, request_id: str) -> list[Any]:
        """Ranks 1..'s handles of a published request (none on one rank, or
        once it was aborted); if a rank cannot publish, or the caller goes
        away meanwhile, every rank unpins it."""
        task = self._rank_handles.get(request_id)
        if task is None:
            return []
        try:
            # Shielded: a cancelled caller must not cancel the ranks' answer,
            # which the abort waits for (`_abort_ranks`).
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except Exception as exc:
            self.abort(request_id)
            raise RequestFailedError(
                request_id, f"a tensor-parallel rank could not publish the cache: {exc}"
            ) from exc
        finally:
            self._rank_handles.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Cancel a prompt still prefilling, or unpin one already published.

        An abort that arrives before its `prefill` call (Ray does not order
        calls to an async actor) makes that call fail at once instead of
        prefilling a prompt nobody reads and pinning its cache until the lease.
        One that arrives while the step finishing the prompt computes cannot
        stop that step's hand-off: the cache it publishes is released once
        the step is over.
        """
        if request_id not in self._active and not self.transceiver.is_pinned(request_id):
            self._aborted.add(request_id)
        self.engine.loop.abort(request_id)
        self.transceiver.abort(request_id)
        self.engine.loop.call_between_steps(partial(self.transceiver.abort, request_id))
        if self.engine.ranks is not None:
            self._abort_ranks(request_id, self.engine.ranks)

    def _abort_ranks(self, request_id: str, ranks: RankGroup) -> None:
        """Unpin a request on ranks 1.. A rank's publish may still be on its
        way and land after this abort: abort again once every rank answered
        it, so no rank keeps the cache pinned until its lease runs out."""
        ranks.abort(request_id)
        task = self._rank_handles.pop(request_id, None)
        if task is not None and not task.done():

            def published(task: asyncio.Task[list[Any]]) -> None:
                if not task.cancelled():
                    task.exception()  # a failed publish is reported by `prefill`, if anyone
                ranks.abort(request_id)

            task.add_done_callback(published)

    def health(self) -> WorkerHealth:
        return WorkerHealth(
            worker_id=self.engine.worker_id,
            role="context",
            healthy=self.engine.loop.healthy,
            detail="" if self.engine.loop.healthy else "engine loop stopped",
            torch_threads=self.torch_threads,
        )

    def load(self) -> WorkerLoad:
        return self.engine.load(num_transferring=self.transceiver.num_pinned)

    def step_timeline(self) -> list[StepRecord]:
        """The engine's recent steps, oldest first (`engine.step_timeline`)."""
        return self.engine.step_timeline()

    async def integrity(self) -> WorkerIntegrity:
        """Cache integrity and free blocks/slots, read between engine steps;
        `num_pinned` counts every rank's pins."""
        await self.start()
        ranks, pinned_by_ranks = self.engine.ranks, 0
        if ranks is not None:
            # A publish on its way pins once it lands: count it then.
            if self._rank_publishes:
                await asyncio.wait(
                    set(self._rank_publishes), timeout=self.config.transfer_timeout_s
                )
            pinned_by_ranks = sum(await ranks.num_pinned())
        return await self.engine.loop.run_between_steps(
            lambda: self.engine.integrity(0, self.transceiver.num_pinned + pinned_by_ranks)
        )

    def report(self) -> WorkerReport:
        """Load and the cache events since the last report (the router's poll)."""
        return WorkerReport(self.load(), self.engine.drain_kv_events())

    def step_stats(self) -> dict[str, float]:
        return self.engine.step_stats()

    async def shutdown(self) -> None:
        """Unpin every published cache, then stop the engine; frees everything."""
        await self._listener.close()
        await self.transceiver.close()
        await self.engine.loop.stop()

    def _publish(self, request: Request) -> None:
        """Runs on the event loop between steps, right after the first token."""
        rid = request.request_id
        manager = self.engine.manager
        try:
            regions = manager.regions(rid)
            handle = self.transceiver.publish(
                rid, regions, manager.layout_signature(), self.config.lease_s, self._on_release
            )
            self._handles[rid] = (handle, self._step_written)
            self._progress.published(rid, handle, self._step_written)
            if self.engine.ranks is not None:
                publish = self.engine.ranks.publish(rid, regions, self.config.lease_s)
                task = asyncio.ensure_future(publish)
                self._rank_handles[rid] = task
                self._rank_publishes.add(task)
                task.add_done_callback(self._rank_publishes.discard)
        except Exception as exc:  # a broken publish must not stop the engine loop
            logger.exception("publishing the cache of request %r failed", rid)
            self._publish_errors[rid] = str(exc)
            manager.free(rid)

    def _on_release(self, request_id: str) -> None:
        # Called by the transceiver (pulled, aborted or lease expired): free
        # the cache once, between steps.
        self._progress.forget(request_id)
        self.engine.loop.call_between_steps(lambda: self._free(request_id))

    def _free(self, request_id: str) -> None:
        self.engine.manager.free(request_id)
        self.engine.manager.release_hold(request_id)

    def _on_step(self, result: StepResult) -> None:
        """Between steps: record which prompts' blocks became final; stop
        offering prompts a preemption moved (their held blocks come back once
        no read of them is in flight). Runs before the step's handoffs are
        published, which wait for the same event as its offers."""
        self._step_written = result.written
        for rid in self._progress.on_step(result.prefilling, result.preempted, result.written):
            self.transceiver.withdraw(rid, lambda rid=rid: self._release_hold(rid))

    def _end_offers(self, request_id: str) -> None:
        """A prompt ended without a published cache: tell its pullers, then
        free what a hold kept once no read is in flight."""
        self._progress.ended(request_id)
        self.transceiver.withdraw(request_id, lambda: self._release_hold(request_id))
        # Late askers still learn that it ended; then the entry goes.
        loop = asyncio.get_running_loop()
        loop.call_later(self.config.transfer_timeout_s, self._progress.forget, request_id)

    def _release_hold(self, request_id: str) -> None:
        self.engine.loop.call_between_steps(lambda: self.engine.manager.release_hold(request_id))
