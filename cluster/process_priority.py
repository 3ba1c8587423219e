"""The serving process's CPU priority: multi-threaded CPU engines go first.

`disagg serve` runs the HTTP server and the router in one process, next to
the workers it starts; on a CPU node they share cores. A CPU worker with
several torch threads runs each step as parallel regions over all of them:
when the kernel preempts one thread for the serving process, the others
wait at the region's end until it runs again, so a short preemption stalls
the whole step. A token the serving process handles a little later only
waits a little longer in its stream. So once the workers are up, the
serving process lowers its own priority (`serving_nice`): where both want a
core the kernel gives it to the workers first; where cores are idle
nothing changes.

`auto` does so only when some CPU instance runs more than one torch thread.
Single-threaded workers lose no more than the preempted slice, and when they
keep every core busy (one context and one generation instance on two cores)
a nice serving process starves instead: in one alternating pair on a loaded
2-core machine, 1P1D at 8 requests/s went from 474 to 359 out tok/s and
its TTFT p50 from 51 to 608 ms at niceness 10.

Only this process's threads change: Ray's daemons and the workers were
started before, and a worker Ray restarts later is forked by Ray's daemon,
so all of them keep their priority.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable
from pathlib import Path

from cluster.plan import InstancePlan

# `serving_nice: auto` where a CPU instance runs several torch threads.
MULTI_THREADED_NICENESS = 10

_THREADS = Path("/proc/self/task")


def serving_niceness(setting: int | str, instances: Iterable[InstancePlan]) -> int:
    """`serving_nice` resolved: a number as given; `auto` is
    `MULTI_THREADED_NICENESS` if some CPU instance gets more than one torch
    thread (`num_cpus` of 2 or more, no GPU), else 0."""
    if setting != "auto":
        return int(setting)
    multi = any(i.num_gpus == 0 and math.floor(i.num_cpus) > 1 for i in instances)
    return MULTI_THREADED_NICENESS if multi else 0


def lower_process_priority(niceness: int) -> None:
    """Raise the niceness of every thread of this process to `niceness` (one
    already nicer keeps its own). Threads started later inherit their
    creator's. Linux keeps a niceness per thread; elsewhere the process's
    own is set."""
    tids = [int(tid.name) for tid in _THREADS.iterdir()] if _THREADS.is_dir() else [0]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            if os.getpriority(os.PRIO_PROCESS, tid) < niceness:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
