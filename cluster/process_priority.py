"""The serving process's CPU priority: the engines it shares cores with go first.

`disagg serve` runs the HTTP server and the router in one process, next to
the workers it starts; on a CPU node they share cores. A CPU worker's engine
step is a parallel region over its torch threads: when the kernel preempts
one of them for the serving process, the whole step waits until that thread
runs again. A token the serving process handles a little later only waits a
little longer in its stream. So once the workers are up, the serving
process lowers its own priority (`serving_nice`): where both want a core the
kernel gives it to the workers first; where cores are idle nothing changes.

Only this process's threads change: Ray's daemons and the workers were
started before, and a worker Ray restarts later is forked by Ray's daemon,
so all of them keep their priority.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

_THREADS = Path("/proc/self/task")


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
