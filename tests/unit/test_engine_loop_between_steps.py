"""`EngineLoop.run_between_steps`: a cancelled waiter never breaks the loop."""

from __future__ import annotations

import asyncio
from typing import Any

from engine.loop import EngineLoop


class _IdleCore:
    """An engine core with no work: the loop only applies queued calls."""

    def has_work(self) -> bool:
        return False


async def test_a_cancelled_waiter_leaves_the_loop_running() -> None:
    core: Any = _IdleCore()
    loop = EngineLoop(core)
    ran: list[str] = []
    # Queued before the loop starts, so the waiter is cancelled before `fn` runs.
    waiter = asyncio.ensure_future(loop.run_between_steps(lambda: ran.append("first")))
    await asyncio.sleep(0)
    waiter.cancel()
    loop.start()
    second = loop.run_between_steps(lambda: ran.append("second") or 7)
    assert await asyncio.wait_for(second, 5.0) == 7  # a dead loop would never answer
    assert ran == ["first", "second"]  # the cancelled call still ran, in order
    assert loop.healthy
    await loop.stop()
