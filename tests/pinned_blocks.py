"""Pin a generation worker's free blocks, so that a test's requests run short
of cache whatever their timing.

A prefetch of a prompt its context worker never prefills allocates the
prompt's blocks on the generation worker and holds them while it waits for
offers (up to the transfer timeout); aborting it frees them. A request that
needs more blocks than are left unpinned must preempt (or be preempted) to
go on, even when it runs alone, until the pin is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from engine.messages import PrefetchRequest


async def until(condition: Callable[[], Awaitable[bool]], what: str, within_s: float = 120) -> None:
    """Poll `condition` until it holds; fail naming `what` after `within_s`."""
    deadline = time.monotonic() + within_s
    while not await condition():
        assert time.monotonic() < deadline, f"no {what} within {within_s}s"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def blocks_pinned(
    gen: Any, holder: Any, pin_id: str, leave: int, block_size: int
) -> AsyncIterator[None]:
    """All of the idle generation actor `gen`'s free blocks but `leave` stay
    pinned by a prefetch from the context actor `holder` inside the block."""
    num_pinned = (await gen.load.remote()).num_free_blocks - leave
    assert num_pinned > 0, f"{leave} blocks to leave, but that is all the cache"
    prompt = list(range(10, 10 + num_pinned * block_size))
    await gen.prefetch.remote(PrefetchRequest(pin_id, prompt, holder))

    async def pinned() -> bool:
        return bool((await gen.load.remote()).num_free_blocks <= leave)

    try:
        await until(pinned, "pinned blocks")
        yield
    finally:
        await gen.abort.remote(pin_id)
