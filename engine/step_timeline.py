"""Every recent engine step of a worker, with what ran around it.

A request's gap between two tokens is one step plus what the worker's event
loop did before the next one: schedule the step and hand its model to the
compute thread, wait for it, wake up and apply its result, send its events,
apply the mutations queued
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

# Steps kept per worker (a few minutes of decode at tens of steps per second).
TIMELINE_LENGTH = 8192


@dataclass(frozen=True)
class StepRecord:
    """One step and the gap after it, in seconds (`start` on `perf_counter`)."""

    start: float
    handoff_s: float  # loop schedules the step and hands it over -> the compute thread starts it
    step_s: float  # the step's wall time on the compute thread
    step_cpu_s: float  # the compute thread's CPU time in it
    process_cpu_s: float  # the whole process's CPU time in it (all threads)
    wake_s: float  # the model returned -> the loop has applied its result
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


@dataclass(frozen=True)
class ComputeTiming:
    """A call on the compute thread: wall start and end, and CPU time in it."""

    begin: float
    end: float
    cpu_s: float  # the calling thread's
    process_cpu_s: float  # every thread's of the process


def timed_call(fn: Callable[[], T]) -> tuple[T, ComputeTiming]:
    """`fn()` and how long it took; run it on the thread to be measured."""
    begin, cpu, process_cpu = time.perf_counter(), time.thread_time(), time.process_time()
    result = fn()
    end = time.perf_counter()
    timing = ComputeTiming(begin, end, time.thread_time() - cpu, time.process_time() - process_cpu)
    return result, timing


@dataclass
class _OpenStep:
    """The newest step, its gap still running."""

    start: float
    timing: ComputeTiming
    resumed: float
    gc_at_start: float
    num_seqs: int
    num_tokens: int


class StepTimeline:
    """The last `TIMELINE_LENGTH` steps of one engine loop.

    The loop calls `starting` just before handing a step over and `stepped`
    when its result is back; mutations between steps go through `applied`,
    waits for work through `idled`. A step's record is complete (its gap
    known) at the next `starting`.
    """

    def __init__(self, length: int = TIMELINE_LENGTH) -> None:
        self.records: deque[StepRecord] = deque(maxlen=length)
        self.gc = GcClock()
        self._open: _OpenStep | None = None
        self._gc_at_start = 0.0
        self._calls = 0
        self._calls_s = 0.0
        self._idle_s = 0.0

    def starting(self) -> float:
        """Close the previous step's gap; returns the new step's start time."""
        now = time.perf_counter()
        if self._open is not None:
            self.records.append(self._close(self._open, now))
            self._open = None
        self._gc_at_start = self.gc.total_s
        self._calls, self._calls_s, self._idle_s = 0, 0.0, 0.0
        return now

    def stepped(self, start: float, timing: ComputeTiming, num_seqs: int, num_tokens: int) -> None:
        resumed = time.perf_counter()
        self._open = _OpenStep(start, timing, resumed, self._gc_at_start, num_seqs, num_tokens)

    def applied(self, num_calls: int, seconds: float) -> None:
        self._calls += num_calls
        self._calls_s += seconds

    def idled(self, seconds: float) -> None:
        self._idle_s += seconds

    def _close(self, step: _OpenStep, now: float) -> StepRecord:
        timing = step.timing
        return StepRecord(
            start=step.start,
            handoff_s=timing.begin - step.start,
            step_s=timing.end - timing.begin,
            step_cpu_s=timing.cpu_s,
            process_cpu_s=timing.process_cpu_s,
            wake_s=step.resumed - timing.end,
            gap_s=now - step.resumed - self._idle_s,
            idle_s=self._idle_s,
            num_seqs=step.num_seqs,
            num_tokens=step.num_tokens,
            num_calls=self._calls,
            calls_s=self._calls_s,
            gc_s=self.gc.total_s - step.gc_at_start,
        )


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
