"""The generation-phase actor (and the aggregated one).

`GenerationWorker.generate` takes a `GenerationRequest` and streams
`TokenEvent`s. With a context result attached it allocates blocks (and a
Mamba slot), pulls the prompt's cache through the transceiver in its own
task — the running batch keeps stepping meanwhile — and then joins the
running batch; its stream starts with one `cache_ready` event (no tokens)
once the pull completed, then the *second* token (the first one came with
the `ContextResult`). Without one it runs the whole request locally
(aggregated mode and conditional disaggregation) and streams from the first
token.

Run as a Ray actor: `ray.remote(GenerationWorker).options(num_cpus=...).remote(config, id, role)`;
iterate `actor.generate.remote(req)` as a streaming generator. An actor Ray
restarts after a crash is rebuilt from the same arguments and starts itself
on its first request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from engine.aborts import AbortedIds
from engine.instance import EngineInstance
from engine.messages import (
    GenerationRequest,
    KVEventBatch,
    TokenEvent,
    WorkerHealth,
    WorkerIntegrity,
    WorkerLoad,
)
from engine.request import Request
from engine.threads import configure_torch_threads, run_on_compute_thread
from engine.transceivers import make_transceiver
from engine.worker_config import WorkerConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

# While blocks for a pull are short, retry the allocation this often.
_ALLOC_RETRY_S = 0.005


class GenerationWorker:
    def __init__(
        self, config: WorkerConfig, worker_id: str = "generation-0", role: str = "generation"
    ) -> None:
        self.torch_threads = configure_torch_threads(config.device)
        self.config = config
        self.role = role
        self.engine = run_on_compute_thread(lambda: EngineInstance.build(config, role, worker_id))
        self.transceiver: Any = (
            make_transceiver(config, self.engine.cache.buffers(), worker_id)
            if role == "generation"
            else None
        )
        self._pulls: dict[str, asyncio.Task[None]] = {}
        self._active: set[str] = set()  # ids between generate() start and end
        self._aborted = AbortedIds()  # aborts that arrived before their generate()
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

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Stream a request's tokens; the last event has `finish_reason` set."""
        await self.start()
        rid = request.request_id
        req = Request(rid, list(request.prompt_token_ids), request.params, images=request.images)
        if rid in self._active:
            yield _error(req, "a request with this id is already in flight on this worker")
            return
        if self._aborted.take(rid):
            yield _error(req, "aborted before it reached this worker", reason="abort")
            return
        self._active.add(rid)
        finished = False
        try:
            if request.context is None:
                stream = self.engine.loop.submit(req)
            else:
                error = await self._pull(req, request)
                if error is not None:
                    finished = True
                    yield error
                    return
                stream = self.engine.loop.submit(req, prefilled=True)
                yield TokenEvent(rid, [], num_prompt_tokens=req.num_prompt_tokens, cache_ready=True)
            while not finished:
                event = await stream.get()
                finished = event.finished
                yield event
        finally:
            self._active.discard(rid)
            if not finished:  # the consumer went away or the call was cancelled
                self.abort(rid)
                self.engine.loop.detach(rid)

    def abort(self, request_id: str) -> None:
        """Cancel a request anywhere in its life; frees its blocks and slot.

        Its stream ends with a final "abort" event. An abort that arrives
        before its `generate` call (Ray does not order calls to an async
        actor) makes that call end at once with "abort".
        """
        if request_id not in self._active:
            self._aborted.add(request_id)
        pull = self._pulls.pop(request_id, None)
        if pull is not None:
            if self.transceiver is not None:
                self.transceiver.abort(request_id)  # also tells the holder to free
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
        return self.engine.load(num_transferring=len(self._pulls))

    async def integrity(self) -> WorkerIntegrity:
        """Cache integrity and free blocks/slots, read between engine steps."""
        await self.start()
        pinned = self.transceiver.num_pinned if self.transceiver is not None else 0
        return await self.engine.loop.run_between_steps(
            lambda: self.engine.integrity(len(self._pulls), pinned)
        )

    def drain_kv_events(self) -> KVEventBatch:
        return self.engine.drain_kv_events()

    def step_stats(self) -> dict[str, float]:
        return self.engine.step_stats()

    async def shutdown(self) -> None:
        """Cancel pulls in flight, stop the engine (open streams end with an
        error) and close the transceiver; frees everything."""
        for task in list(self._pulls.values()):
            task.cancel()
        await self.engine.loop.stop()
        if self.transceiver is not None:
            await self.transceiver.close()

    async def _pull(self, req: Request, request: GenerationRequest) -> TokenEvent | None:
        """Allocate, pull and admit-ready `req`; an error event on failure."""
        context = request.context
        assert context is not None
        rid = req.request_id
        if self.transceiver is None:
            return _error(req, "this worker runs aggregated and cannot pull a cache")
        req.output_token_ids.append(context.first_token_id)
        if context.first_logprob is not None:
            req.output_logprobs.append(context.first_logprob)
        req.num_computed_tokens = req.num_prompt_tokens
        req.first_token_time = time.monotonic()
        task = asyncio.get_running_loop().create_task(self._pull_into_cache(req, context.handle))
        self._pulls[rid] = task
        try:
            await task
        except (asyncio.CancelledError, Exception) as exc:
            aborted = rid not in self._pulls  # abort() took it out
            await self._between_steps(lambda: self.engine.manager.free(rid))
            if isinstance(exc, asyncio.CancelledError) and not aborted:
                raise  # our caller went away
            if aborted:
                return _error(req, "aborted while its cache was in transfer", reason="abort")
            # TransferTimeout, LayoutMismatch, PeerGone, no free blocks in time
            return _error(req, f"cache transfer failed: {exc}")
        else:
            if rid not in self._pulls:  # aborted just as the pull completed
                await self._between_steps(lambda: self.engine.manager.free(rid))
                return _error(req, "aborted while its cache was in transfer", reason="abort")
        finally:
            self._pulls.pop(rid, None)
        return None

    async def _pull_into_cache(self, req: Request, handle: Any) -> None:
        rid, manager = req.request_id, self.engine.manager
        deadline = time.monotonic() + self.config.transfer_timeout_s
        while not await self._between_steps(
            lambda: manager.allocate_for_transfer(rid, req.num_prompt_tokens)
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no free blocks for {req.num_prompt_tokens} tokens within "
                    f"{self.config.transfer_timeout_s}s; raise max_tokens on generation workers"
                )
            await asyncio.sleep(_ALLOC_RETRY_S)
        regions = await self._between_steps(lambda: manager.regions(rid))
        await self.transceiver.pull(
            handle, regions, manager.layout_signature(), self.config.transfer_timeout_s
        )
        await self._between_steps(
            lambda: manager.finish_transfer(rid, req.prompt_token_ids, req.images)
        )

    async def _between_steps(self, fn: Callable[[], T]) -> T:
        return await self.engine.loop.run_between_steps(fn)


def _error(req: Request, message: str, reason: str = "error") -> TokenEvent:
    return TokenEvent(
        request_id=req.request_id,
        token_ids=[],
        finish_reason=reason,
        error=f"request {req.request_id!r}: {message}",
        num_prompt_tokens=req.num_prompt_tokens,
    )
