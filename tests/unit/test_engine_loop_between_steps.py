"""Calls between steps: a cancelled `run_between_steps` waiter never breaks the
loop, `submit`'s `prepare` runs in the gap that admits the request, a loop
that died answers calls instead of queueing them for ever, and a stopped one
ends a new request at once (also when the stop's caller gave up waiting for
a step that hangs); the loop's stats count the steps and the time they
took."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from engine.loop import EngineLoop
from engine.messages import TokenEvent
from engine.request import Request
from engine.sampling import SamplingParams
from tests.scripted_core import ScriptedCore


class _IdleCore:
    """An engine core with no work: the loop only applies queued calls."""

    def has_work(self) -> bool:
        return False


async def test_a_cancelled_waiter_leaves_the_loop_running() -> None:
    core: Any = _IdleCore()
    loop = EngineLoop(core)
    ran: list[str] = []
    # Queued before the loop starts, so the waiter is cancelled before `fn` runs.
    waiter = asyncio.ensure_future(loop.run_between_steps(lambda: ran.append("first")))
    await asyncio.sleep(0)
    waiter.cancel()
    loop.start()
    second = loop.run_between_steps(lambda: ran.append("second") or 7)
    assert await asyncio.wait_for(second, 5.0) == 7  # a dead loop would never answer
    assert ran == ["first", "second"]  # the cancelled call still ran, in order
    assert loop.healthy
    await loop.stop()


class _RecordingCore(_IdleCore):
    """Records admissions; still never has work to step."""

    def __init__(self, ran: list[str]) -> None:
        self.ran = ran

    def add_prefilled(self, request: Any) -> None:
        self.ran.append(f"add {request.request_id}")

    def free_cache(self, request_id: str) -> None:
        self.ran.append(f"free {request_id}")


async def test_prepare_runs_in_the_admitting_gap_and_its_error_ends_the_request() -> None:
    ran: list[str] = []
    loop = EngineLoop(_RecordingCore(ran))
    events: list[TokenEvent] = []
    loop.on_events = events.extend
    params = SamplingParams(max_tokens=4)

    def broken() -> None:
        raise RuntimeError("no transfer in progress")

    loop.submit(Request("ok", [1, 2], params), prefilled=True, prepare=lambda: ran.append("prep"))
    loop.submit(Request("bad", [1, 2], params), prefilled=True, prepare=broken)
    loop.start()
    await asyncio.wait_for(loop.run_between_steps(lambda: None), 5.0)
    assert ran == ["prep", "add ok", "free bad"]  # the failed one's pulled blocks go back
    assert [(e.request_id, e.finish_reason) for e in events] == [("bad", "error")]
    assert "no transfer in progress" in (events[0].error or "")
    await loop.stop()


async def test_a_stopped_loop_ends_a_new_request_with_an_error_instead_of_holding_it() -> None:
    """No step runs after `stop`: a request submitted then (a call that
    reached a worker shutting down) must not wait for one. It ends with an
    error at once, so the router reruns it elsewhere, and a pulled cache is
    freed."""
    ran: list[str] = []
    loop = EngineLoop(_RecordingCore(ran))
    events: list[TokenEvent] = []
    loop.on_events = events.extend
    loop.start()
    await loop.stop()
    loop.submit(Request("late", [1, 2], SamplingParams(max_tokens=4)), prefilled=True)
    assert ran == ["free late"]  # never admitted
    assert [(e.request_id, e.finish_reason) for e in events] == [("late", "error")]
    assert "shutting down" in (events[0].error or "")


STEP_S = 0.02


def _sleep() -> None:
    time.sleep(STEP_S)


async def test_stats_count_steps_and_the_wall_time_spent_in_them() -> None:
    core: Any = ScriptedCore([_sleep] * 3)
    loop = EngineLoop(core)
    loop.start()
    while loop.stats.steps < 3:
        await asyncio.sleep(0.01)
    assert loop.stats.tokens == 3
    assert loop.stats.busy_s >= 3 * STEP_S  # a sleep lasts at least that long
    await loop.stop()


async def test_work_beside_a_step_runs_while_its_model_computes() -> None:
    """A pull's allocation need not wait for the step in flight: the event
    loop is free while the model runs, and `run_beside_step` runs at once,
    where `run_between_steps` waits for the step to end."""
    computing, release = threading.Event(), threading.Event()

    def model() -> None:
        computing.set()
        release.wait(5.0)

    core: Any = ScriptedCore([model])
    loop = EngineLoop(core)
    loop.start()
    await asyncio.get_running_loop().run_in_executor(None, computing.wait, 5.0)
    between = asyncio.ensure_future(loop.run_between_steps(lambda: "after the step"))
    assert loop.run_beside_step(lambda: "now") == "now"
    await asyncio.sleep(0.05)
    assert not between.done() and loop.stats.steps == 0
    release.set()
    assert await asyncio.wait_for(between, 5.0) == "after the step"
    await loop.stop()


async def test_a_loop_that_died_answers_calls_and_takes_no_new_request() -> None:
    """A step that raises kills the loop. Calls queued while it computed run
    then, and later ones at once, instead of waiting for a step that never
    comes; a request submitted afterwards never reaches the core (its stream
    ends with the process, by `on_death`); `stop` still returns."""
    computing, release = threading.Event(), threading.Event()

    def failing_model() -> None:
        computing.set()
        release.wait(5.0)
        raise RuntimeError("injected step failure")

    core: Any = ScriptedCore([failing_model])
    loop = EngineLoop(core)
    events: list[TokenEvent] = []
    deaths: list[BaseException] = []
    loop.on_events = events.extend
    loop.on_death = deaths.append
    params = SamplingParams(max_tokens=4)
    loop.start()
    await asyncio.get_running_loop().run_in_executor(None, computing.wait, 5.0)
    loop.submit(Request("early", [1, 2], params))  # queued behind the failing step
    queued = asyncio.ensure_future(loop.run_between_steps(lambda: "queued"))
    release.set()
    assert await asyncio.wait_for(queued, 5.0) == "queued"
    assert not loop.healthy and [str(e) for e in deaths] == ["injected step failure"]
    assert [(e.request_id, e.finish_reason) for e in events] == [("early", "error")]
    loop.submit(Request("late", [1, 2], params))  # the core has no `add`: never called
    assert len(events) == 1
    assert await asyncio.wait_for(loop.run_between_steps(lambda: 7), 5.0) == 7
    await loop.stop()


async def test_a_stop_given_up_on_during_a_hung_step_still_stops_and_raises_the_cancel() -> None:
    release = threading.Event()
    ran: list[str] = []
    core: Any = ScriptedCore([lambda: release.wait(10)])
    core.free_cache = ran.append
    loop = EngineLoop(core)
    events: list[TokenEvent] = []
    loop.on_events = events.extend
    loop.start()
    try:
        while loop.step_in_flight_s == 0:
            await asyncio.sleep(0.01)
        stopping = asyncio.get_running_loop().create_task(loop.stop())
        await asyncio.sleep(0.05)
        assert not stopping.done()  # a stop waits for the step boundary
        stopping.cancel()
        async with asyncio.timeout(5):
            with pytest.raises(asyncio.CancelledError):
                await stopping
        loop.submit(Request("late", [1, 2], SamplingParams(max_tokens=4)), prefilled=True)
        assert ran == ["late"]
        assert [(e.request_id, e.finish_reason) for e in events] == [("late", "error")]
    finally:
        release.set()
