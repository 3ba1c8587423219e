"""Torch's threads in a worker: how many, and which thread computes.

Several workers may share one machine; each must use only its own share of
cores or they oversubscribe and every step slows down, so the intra-op pool
is sized from the CPUs Ray granted the actor.

Every thread that runs a parallel torch op on CPU becomes the master of its
own OpenMP team, and once a process has more OpenMP threads than CPUs,
libgomp stops spin-waiting between parallel regions (it "throttles"): every
op then pays a thread wake-up. A worker that loaded its model on one thread
and stepped it on another had two teams, and its decode steps ran about 25%
slower. So all of an engine's torch work (building the model and cache, and
every step) runs on one long-lived compute thread per process:
`run_on_compute_thread` from synchronous code, `compute_executor()` for
asyncio's `run_in_executor`.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def compute_executor() -> ThreadPoolExecutor:
    """The process's single compute thread (created on first use, lives with the process)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-compute")
        return _executor


def run_on_compute_thread(fn: Callable[[], T]) -> T:
    """`fn()` on the compute thread, waiting for it; re-raises its error.

    Called from the compute thread itself it just runs `fn` (no deadlock).
    """
    if threading.current_thread().name.startswith("torch-compute"):
        return fn()
    return compute_executor().submit(fn).result()


def granted_cpus() -> float | None:
    """CPUs Ray assigned to the current actor or task; None outside Ray."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    try:
        resources = ray.get_runtime_context().get_assigned_resources()
    except AssertionError:  # the driver process: Ray granted it nothing
        return None
    cpus = resources.get("CPU")
    return float(cpus) if cpus else None


def configure_torch_threads(device: str) -> int:
    """On CPU set `torch.set_num_threads` to the Ray CPU grant (at least 1).

    Returns the thread count in effect. On GPU the grant only covers host-side
    work, so torch's default is left alone.
    """
    if device != "cpu":
        return torch.get_num_threads()
    cpus = granted_cpus()
    if cpus is None:
        return torch.get_num_threads()
    threads = max(1, math.floor(cpus))
    torch.set_num_threads(threads)
    # OpenMP keeps a thread count per thread, and torch reads it once per
    # thread: set it where the compute happens too.
    run_on_compute_thread(lambda: torch.set_num_threads(threads))
    logger.info("torch uses %d threads (Ray granted %.2f CPUs)", threads, cpus)
    return threads
