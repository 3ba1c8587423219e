"""When a step's device work has finished: the barrier before its cache is
exposed, and the clock its time is read from.

On a GPU the host runs ahead of the device: a step that samples nothing (a
prefill chunk short of its prompt's end) returns once its kernels are queued,
and the blocks they write are not final yet. A `StepEvent` is recorded on the
compute stream after a step's last cache write, and every offer or publish of
blocks that step wrote waits for it (`wait_for`): a one-sided NIXL READ, or a
staging copy on another stream, then reads finished bytes only.

    step k:   [launch kernels]--record written_k--> returns at once
    device:   ......[kernels of step k]..(written_k)..
    offer:                wait_for(written_k) ------->  offer blocks of step k

A step is timed by a pair of events, never by a device-wide sync; a reading
counts only once its end event has completed (`StepSpan.done`), so
`PromptPacing` never learns from a step whose kernels were only launched
(`PacedReadings`).

On CPU the work is done when the step returns: events are host timestamps,
complete at once, and waiting for one never yields to the event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


class StepEvent(Protocol):
    """A point in the compute stream's work."""

    def done(self) -> bool:
        """Whether the device has passed this point (never blocks)."""

    def wait(self) -> None:
        """Block the calling thread until `done`."""

    def seconds_since(self, earlier: StepEvent) -> float:
        """Device seconds from `earlier` (of the same kind) to this point;
        both must be done."""


class HostEvent:
    """A point of work that is done when recorded: a host timestamp."""

    def __init__(self) -> None:
        self.at = time.perf_counter()

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def seconds_since(self, earlier: StepEvent) -> float:
        assert isinstance(earlier, HostEvent)
        return self.at - earlier.at


class CudaStepEvent:
    """A `torch.cuda.Event` recorded on the device's current stream."""

    def __init__(self, device: torch.device) -> None:
        self._event = torch.cuda.Event(enable_timing=True)
        self._event.record(torch.cuda.current_stream(device))

    def done(self) -> bool:
        return bool(self._event.query())

    def wait(self) -> None:
        self._event.synchronize()

    def seconds_since(self, earlier: StepEvent) -> float:
        assert isinstance(earlier, CudaStepEvent)
        return float(earlier._event.elapsed_time(self._event)) / 1e3


def record_event(device: torch.device) -> StepEvent:
    """Mark the work queued on `device`'s current stream so far."""
    if device.type == "cuda":
        return CudaStepEvent(device)
    return HostEvent()


async def wait_for(event: StepEvent) -> None:
    """Wait for `event` without blocking the event loop; returns at once,
    without yielding, when it is done (always, on CPU)."""
    if not event.done():
        await asyncio.to_thread(event.wait)


@dataclass(frozen=True)
class StepSpan:
    """A step's device work, from before its forward to after its last write."""

    start: StepEvent
    end: StepEvent

    def done(self) -> bool:
        return self.end.done()

    def seconds(self) -> float:
        return self.end.seconds_since(self.start)


def finished_span() -> StepSpan:
    """The span of a step that did no device work."""
    now = HostEvent()
    return StepSpan(now, now)


@dataclass(frozen=True)
class _Reading:
    num_tokens: int
    prompt_tokens: int
    host_s: float
    span: StepSpan


class PacedReadings:
    """Step timings handed to `observe(num_tokens, prompt_tokens, seconds)`
    (`PromptPacing.observe`) in step order, each once its span is done:
    `host_s` (the host's part, building the batch) plus the span's device
    seconds. A step still running on the device waits in the queue; it is
    never read from the time it took to launch."""

    def __init__(self, observe: Callable[[int, int, float], None]) -> None:
        self._observe = observe
        self._pending: deque[_Reading] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, num_tokens: int, prompt_tokens: int, host_s: float, span: StepSpan) -> None:
        self._pending.append(_Reading(num_tokens, prompt_tokens, host_s, span))
        while self._pending and self._pending[0].span.done():
            reading = self._pending.popleft()
            seconds = reading.host_s + reading.span.seconds()
            self._observe(reading.num_tokens, reading.prompt_tokens, seconds)
