"""A worker's NIXL agent and the one thread that every call on it runs on.

Over UCX on CPU the copy of a READ happens inside `transfer()` (the post):
posting 256 MiB takes ~60 ms. On the worker's event loop that would stall the
running decode batch for the whole copy; NIXL releases the GIL inside its
calls, so posting from a thread keeps the loop turning while bytes move.

One thread, not a pool: the agent is built with NIXL_THREAD_SYNC_NONE (no
locking of its own), so it must never be entered by two threads at once, and
a single-thread executor runs jobs in submission order, so a clean-up
submitted after a post always runs after that post has returned.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The UCX progress thread waits in poll() on the workers' event fds with this
# timeout (rounded up to whole ms). Events (a notification, a READ's reply)
# wake it at once; the timeout only paces a full progress pass over every
# transport. nixl_agent() uses 0, which spins one core per agent. At 1 ms the
# pass ran 1000 times a second per agent: 1.7% of a core idle and 0.3-0.7 s of
# CPU per agent pair in a 5 s served 1P1D run on 2 cores (about 5% of all the
# cluster's CPU, taken from the model's threads). At 10 ms idle cost is at
# the floor of an idle actor and the served run pays 0.05-0.2 s; bench-transfer
# latencies stay within their run-to-run spread (small READs 0.3-1.3 ms).
DEFAULT_PROGRESS_DELAY_US = 10_000


def create_agent(name: str, progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US) -> Any:
    """A `nixl_agent` with a UCX backend whose progress thread waits at most `progress_delay_us`.

    `nixl_agent()` hard-codes the progress-thread delay to 0, so the agent is
    built without backends, its core agent is replaced by one made from a
    config with the delay, and UCX is created on that one. The progress thread
    stays on: without it a READ from an idle peer never completes.
    """
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t, nixlBind

    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    config = nixlBind.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.syncMode = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE.value
    config.pthrDelay = progress_delay_us
    config.lthrDelay = 100000
    agent.agent = nixlBind.nixlAgent(name, config)
    agent.create_backend("UCX", {})
    return agent


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


class AgentThread:
    """Runs callables on one dedicated thread, in submission order.

    `run` awaits a job's result; `submit` queues a job nobody waits for (its
    exception is logged). Both are called from the event loop. After
    `shutdown`, `submit` drops jobs (the agent they would touch is gone) and
    `run` raises RuntimeError.
    """

    def __init__(self, name: str) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        self._closed = False

    async def run(self, job: Callable[..., T], *args: Any) -> T:
        """`job(*args)` on the thread. Cancelling the caller does not stop a started job."""
        if self._closed:
            raise RuntimeError("the NIXL agent thread is shut down")
        return await asyncio.get_running_loop().run_in_executor(self._executor, job, *args)

    def submit(self, job: Callable[..., object], *args: Any) -> None:
        """Queue `job(*args)` behind every job submitted so far; do not wait for it."""
        if self._closed:
            return
        self._executor.submit(job, *args).add_done_callback(_log_failure)

    def shutdown(self) -> None:
        """Stop taking jobs; queued ones still run, on the thread, before it exits."""
        self._closed = True
        self._executor.shutdown(wait=False)


def _log_failure(future: concurrent.futures.Future[object]) -> None:
    exc = None if future.cancelled() else future.exception()
    if exc is not None:
        logger.warning("background NIXL call failed: %s: %s", type(exc).__name__, exc)
