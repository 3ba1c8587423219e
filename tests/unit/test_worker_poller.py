"""The poller's view of a worker that stops answering or whose engine step
hangs: unhealthy at the first unanswered poll (or once the step has run for
a poll timeout), reported stalled for as long as it stays so, and back once
it answers (or the step ends). Pure Python, a scripted actor."""

from __future__ import annotations

import asyncio

import pytest

from cluster.metrics import ServingMetrics
from cluster.routing import worker_poller
from cluster.routing.policies import WorkerState
from cluster.routing.worker_poller import SILENT, STEP_HUNG, WorkerEndpoint, WorkerPoller
from engine.messages import KVEventBatch, WorkerLoad, WorkerReport


class _Actor:
    """`report.remote()` answers while `answering` is set, else never; its
    report says a step has computed for `step_s`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.answering = True
        self.step_s = 0.0
        self.report = self

    def remote(self) -> asyncio.Future[WorkerReport]:
        answer: asyncio.Future[WorkerReport] = asyncio.get_running_loop().create_future()
        if self.answering:
            load = WorkerLoad(
                self.name, "generation", 0, 1, 0, 10, 10, 0, 0, step_in_flight_s=self.step_s
            )
            answer.set_result(WorkerReport(load, KVEventBatch(self.name, [])))
        return answer


async def test_a_silent_worker_is_reported_with_how_long_it_has_been_silent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker_poller, "POLL_TIMEOUT_S", 0.05)
    monkeypatch.setattr(worker_poller, "POLL_INTERVAL_S", 0.01)
    actors = [_Actor("w0"), _Actor("w1")]
    endpoints = [WorkerEndpoint(a.name, a, WorkerState(a.name)) for a in actors]
    silent: list[tuple[str, float]] = []

    def on_stalled(endpoint: WorkerEndpoint, silent_s: float, how: str) -> None:
        assert how == SILENT
        silent.append((endpoint.name, silent_s))

    poller = WorkerPoller(lambda: endpoints, ServingMetrics(), on_stalled)
    poller.start()
    try:
        await asyncio.sleep(0.1)
        assert silent == [] and all(e.state.healthy for e in endpoints)
        actors[0].answering = False
        await asyncio.sleep(0.4)
        assert not endpoints[0].state.healthy and endpoints[1].state.healthy
        assert {name for name, _ in silent} == {"w0"}
        seconds = [s for _, s in silent]
        assert seconds == sorted(seconds) and seconds[0] >= 0.05 and seconds[-1] >= 0.3
        actors[0].answering = True
        await asyncio.sleep(0.1)
        assert endpoints[0].state.healthy
        silent.clear()
        actors[0].answering = False
        await asyncio.sleep(0.1)
        # Counted from its last answer, not from the first silence (0.6 s ago).
        assert silent and all(s < 0.5 for _, s in silent)
    finally:
        await poller.stop()


async def test_a_worker_whose_step_hangs_is_unhealthy_and_reported_while_it_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker_poller, "POLL_TIMEOUT_S", 0.05)
    monkeypatch.setattr(worker_poller, "POLL_INTERVAL_S", 0.01)
    actor = _Actor("w0")
    endpoint = WorkerEndpoint(actor.name, actor, WorkerState(actor.name))
    stalled: list[tuple[float, str]] = []
    poller = WorkerPoller(
        lambda: [endpoint], ServingMetrics(), lambda _e, s, how: stalled.append((s, how))
    )
    poller.start()
    try:
        actor.step_s = 0.01  # a step in flight, shorter than a poll timeout: busy, not hung
        await asyncio.sleep(0.05)
        assert endpoint.state.healthy and stalled and set(stalled) == {(0.01, STEP_HUNG)}
        actor.step_s = 0.2
        await asyncio.sleep(0.05)
        assert not endpoint.state.healthy and (0.2, STEP_HUNG) in stalled
        stalled.clear()
        actor.step_s = 0.0  # the step returned
        await asyncio.sleep(0.05)
        assert endpoint.state.healthy and stalled == []
    finally:
        await poller.stop()


async def test_a_stop_cancelled_midway_still_ends_polling_and_passes_the_cancel_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker_poller, "POLL_INTERVAL_S", 0.01)
    actor = _Actor("w0")
    polls = 0
    answer = actor.remote

    def counted() -> asyncio.Future[WorkerReport]:
        nonlocal polls
        polls += 1
        return answer()

    actor.remote = counted  # type: ignore[method-assign]
    endpoint = WorkerEndpoint(actor.name, actor, WorkerState(actor.name))
    poller = WorkerPoller(lambda: [endpoint], ServingMetrics(), lambda *_: None)
    poller.start()
    await asyncio.sleep(0.05)
    stopping = asyncio.get_running_loop().create_task(poller.stop())
    await asyncio.sleep(0)  # the stop waits for the polling task to end
    stopping.cancel()
    async with asyncio.timeout(5):
        with pytest.raises(asyncio.CancelledError):
            await stopping
    seen = polls
    await asyncio.sleep(0.05)
    assert seen > 0 and polls == seen


async def test_a_worker_silent_after_a_stop_is_expected_is_not_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A signal to the server's process group stops its local workers too:
    once the server expects to stop, their silence is logged at debug only."""
    monkeypatch.setattr(worker_poller, "POLL_TIMEOUT_S", 0.05)
    monkeypatch.setattr(worker_poller, "POLL_INTERVAL_S", 0.01)
    actors = [_Actor("w0"), _Actor("w1")]
    endpoints = [WorkerEndpoint(a.name, a, WorkerState(a.name)) for a in actors]
    poller = WorkerPoller(lambda: endpoints, ServingMetrics())
    caplog.set_level("DEBUG", logger=worker_poller.__name__)
    poller.start()
    try:
        actors[0].answering = False
        await asyncio.sleep(0.15)
        poller.expect_stop()
        actors[1].answering = False
        await asyncio.sleep(0.15)
    finally:
        await poller.stop()
    said = [
        (r.levelname, r.getMessage()) for r in caplog.records if "stopped answering" in r.message
    ]
    assert [level for level, m in said if "w0" in m] == ["WARNING"]
    assert [level for level, m in said if "w1" in m] == ["DEBUG"]
