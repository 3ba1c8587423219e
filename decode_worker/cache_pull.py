"""Cache pulls of a generation worker: a disaggregated request's way from its
`ContextResult` into the running batch.

The worker hands each request that brings a context result to
`CachePulls.admit`, which allocates blocks (and a Mamba slot), pulls the
prompt's cache through the transceiver in its own task — the running batch
keeps stepping meanwhile — and then joins the running batch; the request's
events start with one `cache_ready` event (no tokens) as it joins the batch
(its cache complete), then the *second* token (the first one came with the
`ContextResult`).

Chunk-pipelined transfer: a prefetch (`decode_worker.prefetch`, started by
the router when the prompt is longer than a context prefill chunk) starts
the pull while the context worker still prefills: blocks of finished chunks
move as they are offered, the rest and the Mamba state as soon as the prompt
is published. The pull for the `ContextResult` then joins that prefetch; a
prefetch that could not finish (a preemption on the context side, no room
here, nothing offered in time) frees its blocks and the pull runs as usual.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from decode_worker.prefetch import Prefetches
from engine.messages import ContextResult, TokenEvent
from engine.request import Request
from kvcache.layout import RequestRegions
from transfer.base import Transceiver

if TYPE_CHECKING:
    from engine.instance import EngineInstance

T = TypeVar("T")

# While blocks for a pull are short, retry the allocation this often.
_ALLOC_RETRY_S = 0.005


class CachePulls:
    """The cache pulls of one generation worker, by request id, and the
    prefetches they join; `post` sends a request's events to the worker's
    stream."""

    def __init__(
        self,
        engine: EngineInstance,
        transceiver: Transceiver,
        post: Callable[[list[TokenEvent]], None],
        timeout_s: float,
    ) -> None:
        self.engine = engine
        self.transceiver = transceiver
        self.prefetches = Prefetches(engine, transceiver, timeout_s)
        self.post = post
        self.timeout_s = timeout_s
        # Each ends with True when the cache still needs `finish_transfer`.
        self._tasks: dict[str, asyncio.Task[bool]] = {}
        self._admitting: set[asyncio.Task[None]] = set()  # pull, then join the batch

    @property
    def num_in_transfer(self) -> int:
        """Pulls and prefetches in flight (or placed, waiting for their submit)."""
        return len(self._tasks) + len(self.prefetches)

    def admit(self, req: Request, context: ContextResult) -> None:
        """Pull `req`'s cache, then join it to the running batch (announced
        by `cache_ready`); a failure ends it with an error (or abort) event."""
        # The pull task is registered before this call returns, so an abort
        # from now on finds and cancels it.
        pull = self._start(req, context)
        self._admitting.add(asyncio.get_running_loop().create_task(self._admit(req, pull)))

    def abort(self, request_id: str) -> None:
        """Cancel the pull of `request_id`, if any; its admission then frees
        its blocks and ends it with an "abort" event."""
        pull = self._tasks.pop(request_id, None)
        if pull is None:
            return
        self.transceiver.abort(request_id)  # also tells the holder to free
        if self.engine.ranks is not None:
            self.engine.ranks.abort(request_id)
        pull.cancel()

    async def close(self) -> None:
        """Cancel the pulls and prefetches in flight and wait until each
        pulling request has ended."""
        for task in list(self._tasks.values()):
            task.cancel()
        self.prefetches.cancel_all()
        await asyncio.gather(*self._admitting, return_exceptions=True)

    async def _admit(self, req: Request, pull: asyncio.Task[bool]) -> None:
        """Wait for the pull, then in one gap between steps mark the cache
        complete, announce it (`cache_ready`) and join the batch: the next
        step computes the request's next token."""
        try:
            error = await self._finish(req, pull)
            if error is not None:
                self.post([error])
                return
            ready = TokenEvent(
                req.request_id, [], num_prompt_tokens=req.num_prompt_tokens, cache_ready=True
            )
            manager, unfinished = self.engine.manager, pull.result()

            def finish() -> None:
                if unfinished:  # a prefetch that placed the cache finished it already
                    manager.finish_transfer(req.request_id, req.prompt_token_ids, req.images)
                self.post([ready])

            self.engine.loop.submit(req, prefilled=True, prepare=finish)
        finally:
            self._admitting.discard(asyncio.current_task())  # type: ignore[arg-type]

    def _start(self, req: Request, context: ContextResult) -> asyncio.Task[bool]:
        """Seed `req` with the context's first token and start pulling its
        cache (or join the prefetch already pulling it)."""
        req.output_token_ids.append(context.first_token_id)
        req.drafts = context.draft_token_ids
        req.sample_starts = context.samples  # forked once the cache is here
        if context.first_logprob is not None:
            req.output_logprobs.append(context.first_logprob)
        req.num_computed_tokens = req.num_prompt_tokens
        req.first_token_time = time.monotonic()
        prefetch = self.prefetches.take(req.request_id)
        task = asyncio.get_running_loop().create_task(self._pull(req, context, prefetch))
        self._tasks[req.request_id] = task
        return task

    async def _finish(self, req: Request, pull: asyncio.Task[bool]) -> TokenEvent | None:
        """Wait for the pull; on failure free what it allocated and return the
        request's final error (or abort) event."""
        rid = req.request_id
        try:
            await pull
        except (asyncio.CancelledError, Exception) as exc:
            aborted = rid not in self._tasks  # abort() took it out
            await self._between_steps(lambda: self.engine.manager.free(rid))
            if aborted:
                return error_event(req, "aborted while its cache was in transfer", reason="abort")
            if isinstance(exc, asyncio.CancelledError):  # close()
                return error_event(req, "the worker is shutting down; retry on another worker")
            # TransferTimeout, LayoutMismatch, PeerGone, no free blocks in time
            return error_event(req, f"cache transfer failed: {exc}")
        else:
            if rid not in self._tasks:  # aborted just as the pull completed
                await self._between_steps(lambda: self.engine.manager.free(rid))
                return error_event(req, "aborted while its cache was in transfer", reason="abort")
        finally:
            self._tasks.pop(rid, None)
        return None

    async def _pull(
        self, req: Request, context: ContextResult, prefetch: asyncio.Task[str | None] | None
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

        handles, timeout_s = context.all_handles, self.timeout_s
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
        """Run `allocate` until it finds room or `timeout_s` passes: at once,
        beside a step in flight, so the pull starts without waiting for that
        step to end (blocks it frees count from the next try)."""
        deadline = time.monotonic() + self.timeout_s
        while (regions := self.engine.loop.run_beside_step(allocate)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no free blocks for {req.num_prompt_tokens} tokens within "
                    f"{self.timeout_s}s; raise max_tokens on generation workers"
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


def error_event(req: Request, message: str, reason: str = "error") -> TokenEvent:
    """The final event of a request that ends here without its tokens."""
    error = f"request {req.request_id!r}: {message}"
    return TokenEvent.ended(req.request_id, reason, error, req.num_prompt_tokens)
