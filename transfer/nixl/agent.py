"""A worker's NIXL agent and the one thread that every call on it runs on.

Over UCX on CPU the copy of a READ happens inside `transfer()` (the post),
tens of milliseconds for a large pull. On the worker's event loop that would
stall the running decode batch for the whole copy; NIXL releases the GIL inside its
calls, so posting from a thread keeps the loop turning while bytes move.

One thread runs every call but READ posts, in submission order, and polls
the agent's notifications between jobs, at a pace the event loop sets.
READs of a pull from several holder ranks are posted from `POST_LANES`
threads at once (the agent takes a reader-writer lock of its own, which lets
posts run side by side); a READ's clean-up is queued on the thread that
posted it, so it always runs after that post has returned.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The UCX progress thread waits in poll() on the workers' event fds with this
# timeout (rounded up to whole ms). Events (a notification, a READ's reply)
# wake it at once; the timeout only paces a full progress pass over every
# transport. nixl_agent() uses 0, which spins one core per agent. At 1 ms the
# passes took about 5% of a served 1P1D cluster's CPU on 2 cores, from the
# model's threads; at 10 ms the idle cost is at the floor of an idle actor and
# `python -m benchmarks.transfer.throughput` latencies stay within their
# run-to-run spread (docs/performance.md, "NIXL agent").
DEFAULT_PROGRESS_DELAY_US = 10_000

# UCX guards a worker that several threads use (the agent thread posting
# READs, the progress thread polling) with a spinlock unless told to use a
# mutex. Over CPU memory a READ copies inside its post, under that lock, and
# the progress thread spun on it for the whole copy, taking a good part of a
# core from the copy itself, the holders and the model. With a mutex it
# sleeps: a raw READ's CPU fell by a third and tensor-parallel pulls into two
# puller ranks at once stopped contending (`python -m
# benchmarks.transfer.throughput`; docs/performance.md). An uncontended mutex costs what
# a spinlock does, so GPU pools keep the same setting. A value already in the
# environment wins.
UCX_WORKER_LOCK = ("UCX_USE_MT_MUTEX", "y")

# Threads that post READs at once, each on a UCX worker of its own (UCX binds
# a worker to each thread that posts, in turn). Over CPU memory a READ copies
# inside its post, on the posting thread, and two copies at once move about
# 1.7x the bytes of one on 2 cores (docs/performance.md), with one worker per
# thread; on one shared worker the two serialize.
POST_LANES = 2


def create_agent(name: str, progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US) -> Any:
    """A `nixl_agent` with a UCX backend whose progress thread waits at most `progress_delay_us`.

    `nixl_agent()` hard-codes the progress-thread delay to 0, so the agent is
    built without backends, its core agent is replaced by one made from a
    config with the delay, and UCX is created on that one. The progress thread
    stays on: without it a READ from an idle peer never completes. UCX locks
    its worker with a mutex (`UCX_WORKER_LOCK`), not a spinning lock, and has
    a worker per posting thread (`POST_LANES`); the agent takes its own
    reader-writer lock (NIXL_THREAD_SYNC_RW), so READs may be posted from
    several threads at once while every other call stays exclusive.
    """
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t, nixlBind

    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    config = nixlBind.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.syncMode = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW.value
    config.pthrDelay = progress_delay_us
    config.lthrDelay = 100000
    agent.agent = nixlBind.nixlAgent(name, config)
    with _environment(*UCX_WORKER_LOCK):  # read once, as UCX creates its context
        agent.create_backend("UCX", {"num_workers": str(POST_LANES)})
    return agent


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """`name=value` in this process's environment unless it is set already,
    then as it was: children and other UCX users never see it."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


@functools.cache
def nixl_available() -> bool:
    """Whether NIXL is usable in this process: the one answer every caller uses.

    The test is the import the agent itself needs (`nixl._api`, which loads
    the native library), not a look for the package on the path: an installed
    package whose native part fails to load is not usable, and the `auto`
    rule must not pick it.
    """
    try:
        import nixl._api  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


@dataclass(frozen=True)
class PollPlan:
    """How often an `AgentThread` polls: every `interval_s` until `until`
    (monotonic seconds), every `then_s` after; `math.inf` never."""

    interval_s: float
    until: float = math.inf
    then_s: float = math.inf

    def interval_at(self, now: float) -> float:
        return self.interval_s if now < self.until else self.then_s


NO_POLLS = PollPlan(math.inf)


class AgentThread:
    """Runs callables on one dedicated thread, in submission order, and between
    them a poll (`poll_with`) at the pace the loop sets (`pace`).

    `run` awaits a job's result; `submit` queues a job nobody waits for (its
    exception is logged). Both are called from the event loop. After
    `shutdown`, `submit` drops jobs (the agent they would touch is gone) and
    `run` raises RuntimeError.

    The poll runs here, not as a job the loop sends on each tick: an empty
    notification poll costs the thread a tenth of what the loop's round trip
    (a job there and back, a timer and a task on the loop) cost, and that
    round trip, on 2 busy cores, came at several times the interval asked
    (docs/performance.md, "NIXL agent").
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._poll: Callable[[], None] | None = None
        self._plan = NO_POLLS
        self._poll_now = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    async def run(self, job: Callable[..., T], *args: Any) -> T:
        """`job(*args)` on the thread. Cancelling the caller does not stop a started job."""
        if self._closed:
            raise RuntimeError("the NIXL agent thread is shut down")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put(_Job(future, job, args))
        return await asyncio.wrap_future(future)

    def submit(self, job: Callable[..., object], *args: Any) -> None:
        """Queue `job(*args)` behind every job submitted so far; do not wait for it."""
        if self._closed:
            return
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        future.add_done_callback(_log_failure)
        self._jobs.put(_Job(future, job, args))

    def poll_with(self, poll: Callable[[], None] | None) -> None:
        """Call `poll` on the thread at the pace `pace` sets; None stops polling
        (a poll under way finishes first, before any job queued after this)."""
        self._poll = poll

    def pace(self, plan: PollPlan, now: bool = False) -> None:
        """Poll at `plan`'s pace from here on, and with `now` once at once."""
        self._plan = plan
        self._poll_now = self._poll_now or now
        self._jobs.put(_WAKE)

    def shutdown(self) -> None:
        """Stop taking jobs and polling; queued jobs still run, on the thread, before it exits."""
        self._closed = True
        self._poll = None
        self._jobs.put(None)

    def _main(self) -> None:
        next_poll = math.inf
        while True:
            wait = None
            if self._poll is not None and next_poll < math.inf:
                wait = max(0.0, next_poll - time.monotonic())
            try:
                item = self._jobs.get(timeout=wait)
            except queue.Empty:
                item = _WAKE
            if item is None:
                return
            if item is not _WAKE:
                item.execute()
            poll, now = self._poll, time.monotonic()
            if poll is not None and (now >= next_poll or self._poll_now):
                self._poll_now = False
                try:
                    poll()
                except Exception as exc:
                    logger.warning("NIXL notification poll failed: %s: %s", type(exc).__name__, exc)
                next_poll = now + self._plan.interval_at(now)
            elif item is _WAKE:  # a new pace: the next poll comes no later than it says
                next_poll = min(next_poll, now + self._plan.interval_at(now))


class _Job:
    __slots__ = ("args", "future", "job")

    def __init__(
        self, future: concurrent.futures.Future[Any], job: Callable[..., Any], args: tuple[Any, ...]
    ) -> None:
        self.future, self.job, self.args = future, job, args

    def execute(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return  # cancelled before it started
        try:
            result = self.job(*self.args)
        except BaseException as exc:
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)


_WAKE: Any = object()  # a queue item that only makes the thread re-read its pace


def _log_failure(future: concurrent.futures.Future[object]) -> None:
    exc = None if future.cancelled() else future.exception()
    if exc is not None:
        logger.warning("background NIXL call failed: %s: %s", type(exc).__name__, exc)
