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

import contextlib
import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
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


def pin_process(cpus: Sequence[int]) -> None:
    """Pin every thread of this process, and so every thread it starts later,
    to `cpus` (Linux).

    Instances that share a machine otherwise share its cores at the kernel's
    whim: a context worker's prefill lands on the core a generation worker
    decodes on, and that decode step takes twice its CPU time in wall time.
    Raises `CpuAffinityError` naming the CPUs this machine offers.
    """
    wanted = set(cpus)
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
        for tid in threads:
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                os.sched_setaffinity(tid, wanted)
    except (OSError, AttributeError) as exc:
        offered = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        raise CpuAffinityError(
            f"cannot pin this worker to CPUs {sorted(wanted)} ({exc}); cpu_affinity must "
            f"name CPUs of the node it runs on (this process may use {offered})"
        ) from exc
    logger.info("pinned to CPUs %s", sorted(wanted))


class CpuAffinityError(RuntimeError):
    """`cpu_affinity` names CPUs this machine does not let the worker use."""


def configure_torch_threads(device: str, cpu_affinity: Sequence[int] = ()) -> int:
    """Pin the process to `cpu_affinity` (when given) and, on CPU, set
    `torch.set_num_threads` to the Ray CPU grant (at least 1).

    Returns the thread count in effect. On GPU the grant only covers host-side
    work, so torch's default is left alone.
    """
    if cpu_affinity:
        pin_process(cpu_affinity)
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
