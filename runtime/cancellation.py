"""Cancellation checks for long-lived asyncio loops.

A task that is asked to stop gets one `CancelledError`; code under it may
swallow that one (Python 3.11's `asyncio.wait_for` returns the result when
its inner future finishes as the cancel arrives). A loop that reconnects or
polls forever must then still end: it checks `stop_if_cancelled()` before
each new round, since the request to stop stays counted on the task
(`Task.cancelling()`) until someone calls `uncancel()`.

Stopping is the other side: `stop()` methods cancel their tasks and wait
for them with `cancel_and_wait` (or for a task that ends by itself, with
`wait_ended`), and a component made of several runs each part's stop with
`stop_each`. A cancel of whoever called the stop does not cut that wait
short, which would leave the tasks running; it is raised once they ended,
so the caller still learns of it (swallowing it would leave the caller's
own loops running, as above).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


def current_task_cancelling() -> bool:
    """Whether the running task has been asked to stop (a cancel not yet
    undone); False outside a task."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no event loop runs in this thread
        return False
    return task is not None and task.cancelling() > 0


def stop_if_cancelled() -> None:
    """Raise `CancelledError` when the running task has been asked to stop."""
    if current_task_cancelling():
        raise asyncio.CancelledError


async def wait_ended(*tasks: asyncio.Future[Any] | None) -> None:
    """Return once every task (None skipped) has ended, however it ended,
    without cancelling any. A cancel of the caller meanwhile is raised
    after the wait, not in its middle."""
    pending = [task for task in tasks if task is not None]
    interrupted = False
    while not all(task.done() for task in pending):
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError:
            interrupted = True
    if interrupted:
        raise asyncio.CancelledError


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel the tasks (None skipped) and return once every one has ended
    (`wait_ended`). Ending by that cancel is no error; the first other
    exception a task ended with is raised."""
    pending = [task for task in tasks if task is not None]
    for task in pending:
        task.cancel()
    await wait_ended(*pending)
    for task in pending:
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error


async def stop_each(*stops: Callable[[], Awaitable[None]]) -> None:
    """Await every stop in turn, the later ones even when an earlier one
    failed or the caller was cancelled during it; the first failure, else
    that cancel, is raised at the end."""
    interrupted = False
    error: Exception | None = None
    for stop in stops:
        try:
            await stop()
        except asyncio.CancelledError:
            interrupted = True
        except Exception as exc:
            error = error or exc
    if error is not None:
        raise error
    if interrupted:
        raise asyncio.CancelledError
