"""The calling thread's OpenMP team size, changed for a while.

torch keeps one intra-op thread count per calling thread; a caller that runs
one product or one whole step on fewer threads sets it around that work and
puts the old count back afterwards, also when the work raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def num_threads(threads: int) -> Iterator[None]:
    """torch ops inside run on `threads` threads (at least 1); a no-op when
    that is the count already in effect."""
    before = torch.get_num_threads()
    threads = max(1, threads)
    if threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
