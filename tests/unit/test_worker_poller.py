"""The poller's view of a worker that stops answering: unhealthy at the first
unanswered poll, reported silent for as long as it stays so, and back once it
answers (pure Python, a scripted actor)."""

from __future__ import annotations

import asyncio

import pytest

from cluster import worker_poller
from cluster.metrics import ServingMetrics
from cluster.policies import WorkerState
from cluster.worker_poller import WorkerEndpoint, WorkerPoller
from engine.messages import KVEventBatch, WorkerLoad, WorkerReport


class _Actor:
    """`report.remote()` answers while `answering` is set, else never."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.answering = True
        self.report = self

    def remote(self) -> asyncio.Future[WorkerReport]:
        answer: asyncio.Future[WorkerReport] = asyncio.get_running_loop().create_future()
        if self.answering:
            load = WorkerLoad(self.name, "generation", 0, 0, 0, 10, 10, 0, 0)
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

    def on_silent(endpoint: WorkerEndpoint, silent_s: float) -> None:
        silent.append((endpoint.name, silent_s))

    poller = WorkerPoller(lambda: endpoints, ServingMetrics(), on_silent)
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
