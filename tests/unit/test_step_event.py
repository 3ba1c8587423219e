"""Step events: host events on CPU, waiting without blocking the event loop,
and pacing readings taken only from steps whose device work is done."""

from __future__ import annotations

import asyncio

import torch

from engine.scheduler import PromptPacing
from engine.step_event import HostEvent, PacedReadings, StepSpan, record_event, wait_for
from tests.step_events import GatedEvent


def test_a_cpu_step_is_done_when_recorded_and_timed_by_the_host_clock() -> None:
    start = record_event(torch.device("cpu"))
    end = record_event(torch.device("cpu"))
    assert isinstance(end, HostEvent) and start.done() and end.done()
    assert 0.0 <= end.seconds_since(start) < 1.0
    assert StepSpan(start, end).seconds() == end.seconds_since(start)


async def test_waiting_for_a_running_step_leaves_the_event_loop_free() -> None:
    running = GatedEvent()
    waiting = asyncio.ensure_future(wait_for(running))
    ticks = 0
    while not running.waited:  # the loop runs on while a thread waits
        ticks += 1
        await asyncio.sleep(0.01)
    assert not waiting.done() and ticks > 0
    running.complete()
    await asyncio.wait_for(waiting, 5)


def test_pacing_learns_a_step_only_once_its_device_work_is_done_and_in_step_order() -> None:
    pacing = PromptPacing(target_s=0.1)
    readings = PacedReadings(pacing.observe)
    launched = GatedEvent(seconds=0.64)  # 10 ms a token, once it has run
    readings.add(64, 64, 0.0, StepSpan(HostEvent(), launched))
    assert pacing.seconds_per_token is None  # never the time its launch took
    done = GatedEvent(seconds=0.32)
    done.complete()
    readings.add(64, 64, 0.0, StepSpan(HostEvent(), done))
    assert pacing.seconds_per_token is None and len(readings) == 2
    launched.complete()
    readings.add(64, 64, 0.0, StepSpan(HostEvent(), done))
    # 10 ms, then 5 ms (faster: set at once), then 5 ms again.
    assert pacing.seconds_per_token == 0.005 and len(readings) == 0


def test_a_reading_adds_the_host_part_of_the_step() -> None:
    seen: list[tuple[int, int, float]] = []
    end = GatedEvent(seconds=0.5)
    end.complete()
    PacedReadings(lambda *reading: seen.append(reading)).add(100, 80, 0.25, StepSpan(end, end))
    assert seen == [(100, 80, 0.75)]
