"""`engine.cancellation`: a loop asked to stop ends even after a swallowed cancel."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from engine.cancellation import current_task_cancelling, stop_if_cancelled


async def test_a_loop_that_swallows_a_cancel_still_stops_at_its_next_round() -> None:
    rounds = 0

    async def reconnecting() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            # Swallowed, as a library under the loop may.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()
            stop_if_cancelled()
            await asyncio.sleep(0.01)

    task = asyncio.get_running_loop().create_task(reconnecting())
    await asyncio.sleep(0.01)
    task.cancel()
    async with asyncio.timeout(5):
        with pytest.raises(asyncio.CancelledError):
            await task
    assert rounds == 1


async def test_a_running_task_not_asked_to_stop_goes_on() -> None:
    assert not current_task_cancelling()
    stop_if_cancelled()  # no error


def test_outside_a_task_nothing_is_cancelling() -> None:
    assert not current_task_cancelling()
