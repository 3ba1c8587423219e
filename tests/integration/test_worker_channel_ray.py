"""The router's channel to a real generation worker actor (local Ray): a burst
of requests travels in a few submit calls, each request gets its own tokens,
and a request the worker refuses fails alone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from cluster.launcher import init_local_ray
from cluster.worker_channel import WorkerChannel
from decode_worker.worker import GenerationWorker
from engine.errors import RequestFailedError
from engine.messages import GenerationRequest, TokenEvent
from engine.sampling import SamplingParams
from engine.worker_config import WorkerConfig
from models.embedded.writer import write_checkpoint

NUM_REQUESTS = 16


class _Method:
    def __init__(self, call: Any) -> None:
        self.remote = call


class _CountedActor:
    """A worker's actor handle that counts the requests in each submit call."""

    def __init__(self, actor: Any) -> None:
        self.events, self.abort = actor.events, actor.abort
        self.calls: list[int] = []
        self.submit_many = _Method(self._submit_many)
        self._actor = actor

    def _submit_many(self, requests: list[GenerationRequest]) -> Any:
        self.calls.append(len(requests))
        return self._actor.submit_many.remote(requests)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("bursts"), "llama", "tiny")
    init_local_ray(2, log_to_driver=False)
    config = WorkerConfig(checkpoint=str(checkpoint), block_size=4, max_tokens=2048)
    actor = (
        ray.remote(GenerationWorker).options(num_cpus=0.25).remote(config, "bursts", "aggregated")
    )
    ray.get(actor.start.remote())
    yield actor
    ray.get(actor.shutdown.remote())
    ray.kill(actor)
    ray.shutdown()


def _request(request_id: str, max_tokens: int) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerationRequest(request_id, [5, 6, 7, max_tokens], params)


async def _tokens(channel: WorkerChannel, request: GenerationRequest) -> list[TokenEvent]:
    return [event async for event in channel.stream(request)]


async def test_a_burst_travels_in_few_calls_and_a_refused_request_fails_alone(worker: Any) -> None:
    counted = _CountedActor(worker)
    channel = WorkerChannel("bursts", counted)
    try:
        # "dup" runs on the worker already: the channel's request of that id is refused.
        await worker.submit.remote(_request("dup", 400))
        requests = [_request(f"r{n}", n) for n in range(1, NUM_REQUESTS + 1)]
        results = await asyncio.gather(
            *[_tokens(channel, r) for r in [*requests[:8], _request("dup", 4), *requests[8:]]],
            return_exceptions=True,
        )
    finally:
        worker.abort.remote("dup")
        await channel.stop()
    refused = results.pop(8)
    assert isinstance(refused, RequestFailedError) and "already in flight" in str(refused)
    for request, events in zip(requests, results, strict=True):
        assert not isinstance(events, BaseException), events
        assert {e.request_id for e in events} == {request.request_id}
        assert sum(len(e.token_ids) for e in events) == request.params.max_tokens
        assert events[-1].finish_reason == "length"
    assert sum(counted.calls) == NUM_REQUESTS + 1
    assert len(counted.calls) < NUM_REQUESTS // 2, counted.calls
