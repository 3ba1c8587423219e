"""How many threads a decode-sized CPU step runs on, chosen once by measurement.

A decode step over a few sequences reads every weight once and computes
little: it is bound by memory bandwidth, which one core of a small VM nearly
saturates, while each parallel region of the OpenMP team pays a wake-up and
a join (threads wait passively, `engine.process_env`). Worse, on a machine
where the instance shares its cores with its router and event loop, a region
waits for whichever team thread the kernel has just preempted. On 2 vCPUs,
SmolLM2-135M in fp32 at batch 1-8 decoded no faster on two threads than on
one, step by step in one process (22.9 vs 23.5 ms p50 at batch 1, with 61
team wake-ups per step on two threads), and the served aggregated instance
(2 threads) had an ITL p50 of 32-34 ms against 27.6 for a one-core
generation instance. A large model on a many-core node is the opposite: its
decode step is many times faster on the whole team.

So at startup the runner times one batch-1 decode step on one thread and on
the team, alternating (`calibrate`), and decode-sized steps (at most
`DECODE_SIZED_TOKENS` tokens) run on one thread unless the team is faster by
at least `TEAM_MIN_SPEEDUP`: the margin the team needs to pay for its waits
once the router and event loop load the same cores. Prefill-sized steps
always use the whole team (compute-bound).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from models.cpu_threads import num_threads
from models.layers.fused_linear import SINGLE_THREAD_MAX_ROWS

logger = logging.getLogger(__name__)

# A step of at most this many tokens is decode-sized: memory-bound, as a
# FusedLinear product of this many rows is.
DECODE_SIZED_TOKENS = SINGLE_THREAD_MAX_ROWS
TEAM_MIN_SPEEDUP = 1.2
# Timed steps per thread count (after one untimed each); the fastest counts,
# the one least disturbed by other processes.
CALIBRATION_ROUNDS = 3


@dataclass(frozen=True)
class StepThreads:
    """Threads for decode-sized steps; larger steps keep the caller's count."""

    decode_threads: int | None = None  # None: every step keeps the caller's count

    @contextlib.contextmanager
    def for_step(self, num_tokens: int) -> Iterator[None]:
        if self.decode_threads is None or num_tokens > DECODE_SIZED_TOKENS:
            yield
            return
        with num_threads(self.decode_threads):
            yield


def decode_threads_for(one_thread_s: float, team_s: float, team: int) -> int:
    """`team` when a decode step on it is at least `TEAM_MIN_SPEEDUP` times
    faster than on one thread, else 1."""
    return team if one_thread_s >= TEAM_MIN_SPEEDUP * team_s else 1


def calibrate(decode_step: Callable[[], object]) -> StepThreads:
    """Time `decode_step` on one thread and on the caller's team, alternating,
    and choose the decode-sized steps' thread count (`decode_threads_for`)."""
    team = torch.get_num_threads()
    if team == 1:
        return StepThreads(1)
    best = {1: float("inf"), team: float("inf")}
    for round_ in range(CALIBRATION_ROUNDS + 1):
        for threads in best:
            with num_threads(threads):
                start = time.perf_counter()
                decode_step()
                elapsed = time.perf_counter() - start
            if round_ > 0:  # the first of each warms its kernels up
                best[threads] = min(best[threads], elapsed)
    chosen = decode_threads_for(best[1], best[team], team)
    logger.info(
        "a decode step takes %.2f ms on 1 thread and %.2f ms on %d: decode-sized steps use %d",
        1e3 * best[1],
        1e3 * best[team],
        team,
        chosen,
    )
    return StepThreads(chosen)
