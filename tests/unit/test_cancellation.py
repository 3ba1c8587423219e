"""`runtime.cancellation`: a loop asked to stop ends even after a swallowed
cancel, and a stop waits for its tasks to end without swallowing a cancel
of its caller."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from runtime.cancellation import (
    cancel_and_wait,
    current_task_cancelling,
    stop_each,
    stop_if_cancelled,
    wait_ended,
)


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


async def _slow_to_end(ended: list[str], name: str, error: Exception | None = None) -> None:
    """Runs until cancelled, then takes a while to clean up (and fails with `error`)."""
    try:
        await asyncio.Event().wait()
    finally:
        await asyncio.sleep(0.05)
        ended.append(name)
        if error is not None:
            raise error


async def _cancelled_while_waiting(stopping: asyncio.Task[None]) -> None:
    await asyncio.sleep(0.01)  # the stop is waiting now
    stopping.cancel()
    async with asyncio.timeout(5):
        with pytest.raises(asyncio.CancelledError):
            await stopping


async def test_cancel_and_wait_raises_the_callers_cancel_only_once_the_tasks_ended() -> None:
    ended: list[str] = []
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(_slow_to_end(ended, name)) for name in ("a", "b")]
    await asyncio.sleep(0)
    seen: list[str] = []

    async def stop() -> None:
        try:
            await cancel_and_wait(tasks[0], None, tasks[1])
        finally:
            seen.extend(ended)

    await _cancelled_while_waiting(loop.create_task(stop()))
    assert sorted(seen) == ["a", "b"] and all(task.cancelled() for task in tasks)


async def test_cancel_and_wait_returns_quietly_and_raises_what_a_task_failed_with() -> None:
    ended: list[str] = []
    loop = asyncio.get_running_loop()
    quiet = loop.create_task(_slow_to_end(ended, "quiet"))
    failing = loop.create_task(_slow_to_end(ended, "failing", ValueError("broken")))
    await asyncio.sleep(0)
    await cancel_and_wait(quiet, None)
    with pytest.raises(ValueError, match="broken"):
        await cancel_and_wait(failing)
    assert ended == ["quiet", "failing"]
    await cancel_and_wait()  # nothing to stop


async def test_wait_ended_lets_the_tasks_finish_when_the_caller_is_cancelled() -> None:
    finishing = asyncio.get_running_loop().create_task(asyncio.sleep(0.05, result="done"))
    waiting = asyncio.get_running_loop().create_task(wait_ended(finishing))
    await _cancelled_while_waiting(waiting)
    assert finishing.result() == "done"


async def test_stop_each_runs_every_stop_then_raises_the_first_failure_or_the_cancel() -> None:
    ran: list[str] = []

    async def slow() -> None:
        await asyncio.sleep(0.05)
        ran.append("slow")

    async def failing() -> None:
        ran.append("failing")
        raise RuntimeError("stop failed")

    async def last() -> None:
        ran.append("last")

    stopping = asyncio.get_running_loop().create_task(stop_each(slow, last))
    await _cancelled_while_waiting(stopping)
    # The cancel cut the slow stop short; the next one still ran.
    assert ran == ["last"]
    ran.clear()
    with pytest.raises(RuntimeError, match="stop failed"):
        await stop_each(failing, slow, last)
    assert ran == ["failing", "slow", "last"]
