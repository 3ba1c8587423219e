"""Cancellation checks for long-lived asyncio loops.

A task that is asked to stop gets one `CancelledError`; code under it may
swallow that one (Python 3.11's `asyncio.wait_for` returns the result when
its inner future finishes as the cancel arrives). A loop that reconnects or
polls forever must then still end: it checks `stop_if_cancelled()` before
each new round, since the request to stop stays counted on the task
(`Task.cancelling()`) until someone calls `uncancel()`.
"""

from __future__ import annotations

import asyncio


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
