"""The router's channel to a real generation worker actor (local Ray): a burst
of requests travels in a few frames on the worker's event socket, each
request gets its own tokens, and a request the worker refuses fails alone.
The worker's event socket: a later reader takes the stream over (the earlier
one ends as a plain break), a worker that dies breaks its reader with Ray's
news of the death, and a reader that closes its end ends the worker's call."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any

import pytest
import ray
from ray.exceptions import RayActorError

from cluster.launch.launcher import init_local_ray
from cluster.routing.worker_channel import (
    SocketOpened,
    StreamBrokenError,
    StreamItem,
    WorkerChannel,
    read_event_socket,
)
from decode_worker.worker import GenerationWorker
from engine.errors import RequestFailedError
from engine.event_socket import EventSocketOffer
from engine.event_stream import StreamOpened
from engine.messages import EventItem, GenerationRequest, StepTokens, TokenEvent
from engine.sampling import SamplingParams
from engine.worker_config import WorkerConfig
from models.embedded.writer import write_checkpoint

NUM_REQUESTS = 16


class _CountedBursts:
    """Reads a worker's event socket and counts the requests in each burst
    the channel sends on it."""

    def __init__(self) -> None:
        self.bursts: list[int] = []

    async def open_stream(self, actor: Any) -> AsyncGenerator[StreamItem, None]:
        async with contextlib.aclosing(read_event_socket(actor)) as stream:
            async for item in stream:
                if isinstance(item, SocketOpened):
                    item = SocketOpened(item.incarnation, self._counted(item.send))
                yield item

    def _counted(
        self, send: Callable[[list[GenerationRequest]], None]
    ) -> Callable[[list[GenerationRequest]], None]:
        def counted(requests: list[GenerationRequest]) -> None:
            self.bursts.append(len(requests))
            send(requests)

        return counted


class _NoSubmitCalls:
    """A worker's actor handle without `submit_many`: bursts must go on the socket."""

    def __init__(self, actor: Any) -> None:
        self.event_socket, self.abort = actor.event_socket, actor.abort


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerConfig]:
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("bursts"), "llama", "tiny")
    init_local_ray(2, log_to_driver=False)
    yield WorkerConfig(checkpoint=str(checkpoint), block_size=4, max_tokens=2048)
    ray.shutdown()


def _start(config: WorkerConfig, name: str) -> Any:
    actor = ray.remote(GenerationWorker).options(num_cpus=0.25).remote(config, name, "aggregated")
    ray.get(actor.start.remote())
    return actor


@pytest.fixture(scope="module")
def worker(config: WorkerConfig) -> Iterator[Any]:
    actor = _start(config, "bursts")
    yield actor
    ray.get(actor.shutdown.remote())
    ray.kill(actor)


def _request(request_id: str, max_tokens: int) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerationRequest(request_id, [5, 6, 7, max_tokens], params)


async def _tokens(channel: WorkerChannel, request: GenerationRequest) -> list[TokenEvent]:
    return [event async for event in channel.stream(request)]


async def test_a_burst_travels_in_few_frames_and_a_refused_request_fails_alone(
    worker: Any,
) -> None:
    counted = _CountedBursts()
    channel = WorkerChannel("bursts", _NoSubmitCalls(worker), open_stream=counted.open_stream)
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
    assert sum(counted.bursts) == NUM_REQUESTS + 1
    assert len(counted.bursts) < NUM_REQUESTS // 2, counted.bursts


def _tokens_of(request_id: str, batch: list[EventItem]) -> int:
    rows = [item for item in batch if isinstance(item, StepTokens)]
    events = [item for item in batch if isinstance(item, TokenEvent)]
    return sum(step.request_ids.count(request_id) for step in rows) + sum(
        len(e.token_ids) for e in events if e.request_id == request_id
    )


async def test_a_later_reader_takes_the_event_socket_over(worker: Any) -> None:
    first = read_event_socket(worker)
    second = read_event_socket(worker)
    try:
        assert isinstance(await anext(first), StreamOpened)
        opened = await anext(second)
        assert isinstance(opened, StreamOpened)
        # The takeover closes the first socket at its next wake-up: a plain
        # break, not news of a death. Events posted before it (an earlier
        # test's) may still reach the first reader; the new request's never do.
        await worker.submit.remote(_request("over", 3))
        with pytest.raises(StreamBrokenError):
            while True:
                batch = await asyncio.wait_for(anext(first), 10.0)
                assert isinstance(batch, list) and _tokens_of("over", batch) == 0
        tokens = 0
        while tokens < 3:
            batch = await asyncio.wait_for(anext(second), 10.0)
            assert isinstance(batch, list)
            tokens += _tokens_of("over", batch)
    finally:
        await first.aclose()
        await second.aclose()


async def test_a_dead_workers_socket_breaks_with_rays_news(config: WorkerConfig) -> None:
    actor = _start(config, "doomed")
    stream = read_event_socket(actor)
    try:
        assert isinstance(await anext(stream), StreamOpened)
        ray.kill(actor, no_restart=True)
        with pytest.raises(RayActorError):
            await asyncio.wait_for(anext(stream), 10.0)
    finally:
        await stream.aclose()


async def test_the_worker_ends_its_socket_call_once_the_reader_closes_its_end(worker: Any) -> None:
    call = worker.event_socket.remote()
    offer: EventSocketOffer = await (await anext(call))
    _, writer = await asyncio.open_connection(offer.host, offer.port)
    writer.write(offer.ticket)
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    # Nothing is posted meanwhile: the closed connection alone ends the call.
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(call), 5.0)
