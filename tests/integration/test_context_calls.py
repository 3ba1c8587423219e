"""The router's `prefill` calls to a real context worker actor (local Ray):
the first goes as a Ray call and opens the worker's call socket, later ones
travel on it with the Ray call's answers (a result, a refusal); a caller
that leaves cancels the prefill there, which unpins its cache; a worker that
dies fails the call waiting on its socket with Ray's news of the death."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.exceptions import RayActorError

from cluster.launch.launcher import init_local_ray
from cluster.routing.context_calls import ContextCalls
from engine.errors import RequestFailedError
from engine.messages import ContextRequest
from engine.sampling import SamplingParams
from engine.worker_config import WorkerConfig
from models.embedded.writer import write_checkpoint
from prefill_worker.worker import ContextWorker

MAX_TOKENS = 256


class _Method:
    def __init__(self, call: Any) -> None:
        self.remote = call


class _CountedActor:
    """A context worker's handle that counts the `prefill` Ray calls."""

    def __init__(self, actor: Any) -> None:
        self.call_socket = actor.call_socket
        self.ray_calls = 0
        self.prefill = _Method(self._prefill)
        self._actor = actor

    def _prefill(self, request: ContextRequest) -> Any:
        self.ray_calls += 1
        return self._actor.prefill.remote(request)


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerConfig]:
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("context-calls"), "llama", "tiny")
    init_local_ray(2, log_to_driver=False)
    yield WorkerConfig(
        checkpoint=str(checkpoint), block_size=4, max_tokens=MAX_TOKENS, cluster_secret="calls"
    )
    ray.shutdown()


def _start(config: WorkerConfig, name: str) -> Any:
    actor = ray.remote(ContextWorker).options(num_cpus=0.25).remote(config, name)
    ray.get(actor.start.remote())
    return actor


@pytest.fixture(scope="module")
def worker(config: WorkerConfig) -> Iterator[Any]:
    actor = _start(config, "context-calls")
    yield actor
    ray.get(actor.shutdown.remote())
    ray.kill(actor)


def _request(request_id: str, prompt: list[int]) -> ContextRequest:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    return ContextRequest(request_id, prompt, params)


async def _socket_open(calls: ContextCalls) -> None:
    for _ in range(1000):
        if calls._socket is not None:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the call socket did not open within 10 s")


async def _unpinned(actor: Any) -> None:
    for _ in range(200):
        if (await actor.integrity.remote()).num_pinned == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the context worker still pins a cache")


async def test_calls_travel_on_the_socket_with_the_ray_calls_answers(worker: Any) -> None:
    counted = _CountedActor(worker)
    calls = ContextCalls("context-calls", counted)
    prompt = [5, 9, 2, 7, 11, 3]
    try:
        by_ray = await asyncio.wait_for(calls.prefill(_request("by-ray", prompt)), 30.0)
        assert counted.ray_calls == 1
        await _socket_open(calls)
        by_socket = await asyncio.wait_for(calls.prefill(_request("by-socket", prompt)), 30.0)
        with pytest.raises(RequestFailedError, match="raise max_tokens"):
            too_long = _request("too-long", list(range(MAX_TOKENS + 1)))
            await asyncio.wait_for(calls.prefill(too_long), 30.0)
        assert counted.ray_calls == 1
        assert by_socket.request_id == "by-socket" and by_socket.handle is not None
        assert by_socket.first_token_id == by_ray.first_token_id
    finally:
        await calls.stop()
        for rid in ("by-ray", "by-socket"):
            worker.abort.remote(rid)
    await _unpinned(worker)


async def test_a_caller_that_leaves_cancels_the_prefill_there(worker: Any) -> None:
    calls = ContextCalls("context-calls", worker)
    try:
        await calls.prefill(_request("opener", [1, 2, 3]))
        worker.abort.remote("opener")
        await _socket_open(calls)
        left = asyncio.ensure_future(calls.prefill(_request("left", list(range(3, 200)))))
        await asyncio.sleep(0)  # sent
        left.cancel()
        with pytest.raises(asyncio.CancelledError):
            await left
        await _unpinned(worker)  # with the socket still open
        assert calls._socket is not None
    finally:
        await calls.stop()


async def test_a_dead_workers_socket_fails_the_call_with_rays_news(config: WorkerConfig) -> None:
    actor = _start(config, "doomed-context")
    calls = ContextCalls("doomed-context", actor)
    try:
        await calls.prefill(_request("opener", [1, 2, 3]))
        await _socket_open(calls)
        # A prompt that prefills for a while, so the kill comes while it waits.
        waiting = asyncio.ensure_future(calls.prefill(_request("waiting", list(range(3, 250)))))
        await asyncio.sleep(0)
        ray.kill(actor, no_restart=True)
        with pytest.raises(RayActorError):
            await asyncio.wait_for(waiting, 10.0)
    finally:
        await calls.stop()
