"""Pulls that start before their request: chunk-pipelined transfer, puller side.

The router sends a generation worker a `PrefetchRequest` as the context
worker starts prefilling a long prompt. A prefetch allocates blocks for the
whole prompt, then asks the holder's `blocks_ready` again and again:

    blocks [0, 8) final   -> pull(release=False) into the same logical blocks
    blocks [8, 16) final  -> pull(release=False)
    published             -> pull the rest and the Mamba state, releasing the holder

and ends with the transfer id of the cache it placed. The worker's `submit`
with the `ContextResult` takes (`take`) the prefetch and joins it. A prefetch
that cannot finish (no room here, nothing offered in time, the holder
withdrew a preempted prompt, a failed pull) frees its blocks and ends with
None: the submit then pulls as it would without pipelining. A placed cache
nobody takes within the transfer timeout is freed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from engine.messages import BlocksReady, PrefetchRequest
from kvcache.layout import RequestRegions
from transfer.base import Transceiver

if TYPE_CHECKING:
    from engine.instance import EngineInstance

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Prefetches:
    """The prefetches of one generation worker, by request id."""

    def __init__(self, engine: EngineInstance, transceiver: Transceiver, timeout_s: float) -> None:
        self.engine = engine
        self.transceiver = transceiver
        self.timeout_s = timeout_s
        # Each ends with the transfer id of the cache it placed, or None.
        self._tasks: dict[str, asyncio.Task[str | None]] = {}
        self.num_pipelined_blocks = 0  # blocks pulled while their prompt prefilled

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, request: PrefetchRequest) -> None:
        """Start a prefetch; a second one for the same id is ignored."""
        rid = request.request_id
        if rid in self._tasks:
            return
        task = asyncio.get_running_loop().create_task(self._run(request))
        self._tasks[rid] = task
        task.add_done_callback(lambda _: self._on_done(rid, task))

    def take(self, request_id: str) -> asyncio.Task[str | None] | None:
        """Hand a prefetch to the request's pull (which awaits it), if any."""
        return self._tasks.pop(request_id, None)

    def discard(self, request_id: str) -> None:
        """Cancel a prefetch (it frees its blocks), or free the cache it placed."""
        task = self._tasks.pop(request_id, None)
        if task is None:
            return
        if not task.done():
            task.cancel()
        elif _placed(task):
            manager = self.engine.manager
            self.engine.loop.call_between_steps(lambda: manager.free(request_id))

    def cancel_all(self) -> None:
        for task in self._tasks.values():
            task.cancel()

    async def _run(self, request: PrefetchRequest) -> str | None:
        """Pull a prompt's cache as its context worker offers it; returns the
        transfer id once the whole cache is in place (the holder released),
        or None after freeing the blocks (the submit then pulls as usual)."""
        rid, manager = request.request_id, self.engine.manager
        num_tokens = len(request.prompt_token_ids)
        if not await self._between_steps(lambda: manager.allocate_for_transfer(rid, num_tokens)):
            return None  # no room now; the submit's pull waits for blocks
        try:
            num_pulled = 0
            while True:
                ready: BlocksReady = await request.holder.blocks_ready.remote(rid, num_pulled)
                if ready.handle is None:
                    break  # nothing more will be offered
                await self._pull_blocks(rid, ready)
                if ready.final:
                    await self._between_steps(
                        lambda: manager.finish_transfer(
                            rid, request.prompt_token_ids, request.images
                        )
                    )
                    return ready.handle.transfer_id
                self.num_pipelined_blocks += ready.end_block - num_pulled
                num_pulled = ready.end_block
        except asyncio.CancelledError:
            await self._between_steps(lambda: manager.free(rid))
            raise
        except Exception as exc:  # the submit's own pull reports what is wrong
            logger.info("prefetch of request %r stopped: %s", rid, exc)
        await self._between_steps(lambda: manager.free(rid))
        return None

    async def _pull_blocks(self, rid: str, ready: BlocksReady) -> None:
        """Pull the blocks `ready` offers into the same logical blocks here."""
        manager, handle = self.engine.manager, ready.handle
        assert handle is not None

        def regions() -> RequestRegions:
            table = manager.block_table(rid)[ready.first_block : ready.end_block]
            slot = manager.mamba_slot(rid) if ready.final else None
            return manager.layout.request_regions(table, slot)

        dest = await self._between_steps(regions)
        await self.transceiver.pull(
            handle,
            dest,
            manager.layout_signature(),
            self.timeout_s,
            release=ready.final,
        )

    def _on_done(self, rid: str, task: asyncio.Task[str | None]) -> None:
        """A prefetch that freed its blocks is forgotten; one that placed the
        cache waits for its submit, which must come within the timeout."""
        if self._tasks.get(rid) is not task:
            return
        if not _placed(task):
            del self._tasks[rid]
            return
        asyncio.get_running_loop().call_later(self.timeout_s, self._expire, rid, task)

    def _expire(self, rid: str, task: asyncio.Task[str | None]) -> None:
        if self._tasks.get(rid) is task:
            logger.warning("request %r: no submit came for its pulled cache; freeing it", rid)
            self.discard(rid)

    async def _between_steps(self, fn: Callable[[], T]) -> T:
        return await self.engine.loop.run_between_steps(fn)


def _placed(task: asyncio.Task[str | None]) -> bool:
    """Whether a finished prefetch placed a cache (which then needs freeing or a taker)."""
    return not task.cancelled() and task.exception() is None and task.result() is not None
