"""Keep Python's garbage collector off the objects a process made at start-up.

A serving process and a worker hold millions of long-lived objects once they
have imported torch, Ray and the model (modules, functions, parameters'
Python wrappers). The cyclic collector's full passes walk all of them, and
the steady stream of short-lived objects of serving (events, dicts, futures)
triggers such passes: sampled natively, the serving process's event loop
spent as long in `gc_collect` as in all of its request and token work.
Freezing the start-up heap moves it to a permanent generation the collector
never scans; objects made afterwards are collected as before. At exit the
heap is unfrozen again, so the interpreter's final collection still frees it
(extension modules such as triton's report leaks otherwise).
"""

from __future__ import annotations

import atexit
import gc

_frozen = False


def freeze_startup_heap() -> None:
    """Collect once, then exempt every object alive now from later passes.
    Call when start-up is done; later calls in the same process do nothing."""
    global _frozen
    if _frozen:
        return
    _frozen = True
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
