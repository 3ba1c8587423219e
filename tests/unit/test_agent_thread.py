"""The NIXL agent thread: jobs in submission order, and notification polls between them at the loop's pace."""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time

import pytest

from transfer.nixl.agent import NO_POLLS, AgentThread, PollPlan

# Generous: these tests check that something happens (or stops), never how fast.
WITHIN_S = 5.0


def test_a_plan_polls_fast_until_its_deadline_then_at_its_slow_pace() -> None:
    plan = PollPlan(0.001, until=10.0, then_s=0.05)

    assert plan.interval_at(9.9) == 0.001
    assert plan.interval_at(10.0) == 0.05
    assert NO_POLLS.interval_at(0.0) == math.inf


async def test_jobs_run_in_submission_order_on_one_thread() -> None:
    thread = AgentThread("test-agent")
    seen: list[tuple[int, str]] = []
    try:
        for i in range(5):
            thread.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
        assert await thread.run(lambda: len(seen)) == 5
    finally:
        thread.shutdown()
    assert [i for i, _ in seen] == list(range(5))
    assert {name for _, name in seen} == {"test-agent"}


async def test_a_failing_job_raises_in_its_caller_and_the_thread_goes_on() -> None:
    thread = AgentThread("test-agent")
    try:
        with pytest.raises(ZeroDivisionError):
            await thread.run(lambda: 1 / 0)
        assert await thread.run(lambda: "still here") == "still here"
    finally:
        thread.shutdown()


async def test_polls_come_at_the_pace_and_stop_when_told() -> None:
    thread = AgentThread("test-agent")
    polled = threading.Event()
    count = 0

    def poll() -> None:
        nonlocal count
        count += 1
        polled.set()

    try:
        thread.poll_with(poll)
        await asyncio.sleep(0.05)
        assert count == 0  # no pace yet: no polls

        thread.pace(PollPlan(0.001))
        await asyncio.to_thread(polled.wait, WITHIN_S)
        polled.clear()
        await asyncio.to_thread(polled.wait, WITHIN_S)  # and again, unasked
        assert count >= 2

        thread.poll_with(None)
        settled = await thread.run(lambda: count)  # a job after the stop: no poll after it
        await asyncio.sleep(0.05)
        assert count == settled
    finally:
        thread.shutdown()


async def test_pace_now_polls_at_once_even_on_a_slow_pace() -> None:
    thread = AgentThread("test-agent")
    polled = threading.Event()
    try:
        thread.poll_with(polled.set)
        thread.pace(PollPlan(3600.0), now=True)
        assert await asyncio.to_thread(polled.wait, WITHIN_S)
    finally:
        thread.shutdown()


async def test_a_poll_under_way_when_polling_stops_ends_before_the_next_job() -> None:
    """What `NixlTransceiver.close` relies on: stop polling, then a job that
    closes the agent runs only after any poll touching it has returned."""
    thread = AgentThread("test-agent")
    in_poll, release = threading.Event(), threading.Event()
    order: list[str] = []

    def poll() -> None:
        order.append("poll begins")
        in_poll.set()
        release.wait(WITHIN_S)
        order.append("poll ends")

    try:
        thread.poll_with(poll)
        thread.pace(NO_POLLS, now=True)
        assert await asyncio.to_thread(in_poll.wait, WITHIN_S)
        thread.poll_with(None)
        closing = asyncio.ensure_future(thread.run(lambda: order.append("close")))
        await asyncio.sleep(0.05)
        assert not closing.done()
        release.set()
        await closing
    finally:
        thread.shutdown()
    assert order == ["poll begins", "poll ends", "close"]


async def test_after_shutdown_queued_jobs_still_run_and_new_ones_are_refused() -> None:
    thread = AgentThread("test-agent")
    ran = threading.Event()

    def slow_job() -> None:
        time.sleep(0.05)
        ran.set()

    thread.submit(slow_job)
    thread.shutdown()
    assert await asyncio.to_thread(ran.wait, WITHIN_S)
    thread.submit(lambda: pytest.fail("a job after shutdown ran"))
    with pytest.raises(RuntimeError, match="shut down"):
        await thread.run(lambda: None)


def test_the_ucx_worker_lock_setting_is_seen_only_while_ucx_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """UCX reads `UCX_USE_MT_MUTEX` as it creates its context: set then, and
    gone after (children and other UCX users never see it); a value the
    user set wins."""
    from transfer.nixl.agent import UCX_WORKER_LOCK, _environment

    name, value = UCX_WORKER_LOCK
    monkeypatch.delenv(name, raising=False)
    with _environment(name, value):
        assert os.environ[name] == "y"
    assert name not in os.environ

    monkeypatch.setenv(name, "n")
    with _environment(name, value):
        assert os.environ[name] == "n"
    assert os.environ[name] == "n"
