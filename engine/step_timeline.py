"""Every recent engine step of a worker, with what ran around it.

A request's gap between two tokens is one step plus what the worker's event
loop did before the next one: hand the step to the compute thread, wait for
it, wake up with its result, send its events, apply the mutations queued
meanwhile (requests joining, blocks allocated for a pull, aborts), and run
whatever else was ready (transfers, actor calls). One `StepRecord` per step
splits that period:

    start      begin            end     resumed                 next start
      |-handoff-|---step (cpu)---|-wake--|--gap: calls + other---|
      <----------------------------- period ------------------------->

A step whose wall time far exceeds its compute thread's CPU time waited for
a core (another process ran there) or for the GIL; a long gap with few calls
means other event-loop work ran; `gc_s` is the cyclic collector's pause time
inside the period, on any thread.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Steps kept per worker (a few minutes of decode at tens of steps per second).
TIMELINE_LENGTH = 8192


@dataclass(frozen=True)
class StepRecord:
    """One step and the gap after it, in seconds (`start` on `perf_counter`)."""

    start: float
    handoff_s: float  # loop hands the step over -> the compute thread starts it
    step_s: float  # the step's wall time on the compute thread
    step_cpu_s: float  # the compute thread's CPU time in it
    process_cpu_s: float  # the whole process's CPU time in it (all threads)
    wake_s: float  # the step returned -> the loop resumes with its result
    gap_s: float  # the loop resumed -> the next step's start (idle time excluded)
    idle_s: float  # of the gap, waiting for work (no request to step)
    num_seqs: int
    num_tokens: int
    num_calls: int  # mutations applied in the gap (admissions, allocations, aborts)
    calls_s: float  # their time
    gc_s: float  # collector pauses within the period

    @property
    def period_s(self) -> float:
        """Step to next step, what a request running on both waits between tokens."""
        return self.handoff_s + self.step_s + self.wake_s + self.gap_s


class GcClock:
    """Total seconds this process spent in the cyclic garbage collector."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._started = 0.0

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
        else:
            self.total_s += now - self._started


class StepTimeline:
    """The last `TIMELINE_LENGTH` steps of one engine loop.

    The loop calls `stepped` when a step's result is back and `starting` just
    before handing over the next one; mutations between them go through
    `applied`. The gap of the newest step is completed by the next `starting`.
    """

    def __init__(self, length: int = TIMELINE_LENGTH) -> None:
        self.records: deque[StepRecord] = deque(maxlen=length)
        self.gc = GcClock()
        self._open: dict[str, Any] | None = None  # the newest step, gap still running
        self._calls = 0
        self._calls_s = 0.0
        self._idle_s = 0.0

    def starting(self) -> float:
        """Close the previous step's gap; returns the new step's start time."""
        now = time.perf_counter()
        if self._open is not None:
            gap = now - self._open.pop("resumed") - self._idle_s
            gc_s = self.gc.total_s - self._open.pop("gc_at_start")
            self.records.append(
                StepRecord(
                    **self._open,
                    gap_s=gap,
                    idle_s=self._idle_s,
                    num_calls=self._calls,
                    calls_s=self._calls_s,
                    gc_s=gc_s,
                )
            )
            self._open = None
        self._calls, self._calls_s, self._idle_s = 0, 0.0, 0.0
        return now

    def stepped(
        self,
        start: float,
        begin: float,
        end: float,
        cpu_s: float,
        process_cpu_s: float,
        num_seqs: int,
        num_tokens: int,
        gc_at_start: float,
    ) -> None:
        resumed = time.perf_counter()
        self._open = {
            "start": start,
            "handoff_s": begin - start,
            "step_s": end - begin,
            "step_cpu_s": cpu_s,
            "process_cpu_s": process_cpu_s,
            "wake_s": resumed - end,
            "num_seqs": num_seqs,
            "num_tokens": num_tokens,
            "resumed": resumed,
            "gc_at_start": gc_at_start,
        }

    def applied(self, num_calls: int, seconds: float) -> None:
        self._calls += num_calls
        self._calls_s += seconds

    def idled(self, seconds: float) -> None:
        self._idle_s += seconds


@dataclass(frozen=True)
class LongSteps:
    """Periods longer than `factor` x the median, and where their excess went."""

    num_steps: int
    median_period_s: float
    factor: float
    long: tuple[StepRecord, ...]

    @property
    def num_long(self) -> int:
        return len(self.long)


def long_steps(
    records: Sequence[StepRecord], factor: float = 1.5, decode_only: bool = True
) -> LongSteps:
    """The steps whose period exceeds `factor` x the median period.

    Steps after which the loop waited for work are left out (no request
    waited on that period). `decode_only` keeps steps where every sequence
    computed one token (a prefill chunk is long by design, and a generation
    worker that pulls its caches runs none).
    """
    kept = [
        r for r in records if r.idle_s == 0.0 and (not decode_only or r.num_tokens == r.num_seqs)
    ]
    if not kept:
        return LongSteps(0, 0.0, factor, ())
    median = statistics.median(r.period_s for r in kept)
    long = tuple(r for r in kept if r.period_s > factor * median)
    return LongSteps(len(kept), median, factor, long)
