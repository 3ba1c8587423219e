"""Token events leave a worker one batch per engine step and are split per request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from decode_worker.worker import GenerationWorker
from engine.event_stream import EventDemux, EventOutbox, StreamOpened, read_stream
from engine.messages import EventItem, GenerationRequest, StepTokens, TokenEvent
from engine.sampling import SamplingParams
from engine.worker_config import WorkerConfig
from models.embedded.writer import write_checkpoint


def _event(rid: str, token: int, reason: str | None = None) -> TokenEvent:
    return TokenEvent(rid, [token], finish_reason=reason)


def _events(batch: list[EventItem]) -> list[TokenEvent]:
    """A batch's events in order, a `StepTokens` one per row."""
    out: list[TokenEvent] = []
    for item in batch:
        out += [item.event(i) for i in range(len(item))] if isinstance(item, StepTokens) else [item]
    return out


async def test_outbox_hands_out_everything_posted_since_the_last_wake_as_one_batch() -> None:
    outbox = EventOutbox()
    outbox.post([_event("a", 1), _event("b", 1)])  # no reader yet: the events wait
    outbox.post([_event("a", 2)])
    batches = outbox.batches()
    first = await anext(batches)
    assert [(e.request_id, e.token_ids) for e in first] == [("a", [1]), ("b", [1]), ("a", [2])]
    outbox.post([_event("b", 2)])
    assert [e.token_ids for e in await anext(batches)] == [[2]]


async def test_a_new_outbox_reader_takes_over_from_the_old_one() -> None:
    outbox = EventOutbox()
    old = outbox.batches()
    waiting = asyncio.ensure_future(anext(old))
    await asyncio.sleep(0)
    new = outbox.batches()
    outbox.post([_event("a", 1)])
    assert [e.token_ids for e in await anext(new)] == [[1]]
    with pytest.raises(StopAsyncIteration):
        await waiting


async def test_the_takeover_happens_when_batches_is_called() -> None:
    """Events posted after the call belong to the new reader, even before it
    first asks for a batch (a stream announces itself before it reads)."""
    outbox = EventOutbox()
    old = outbox.batches()
    outbox.post([_event("a", 1)])
    assert [e.token_ids for e in await anext(old)] == [[1]]
    new = outbox.batches()
    outbox.post([_event("a", 2)])
    with pytest.raises(StopAsyncIteration):
        await anext(old)
    assert [e.token_ids for e in await anext(new)] == [[2]]


async def test_demux_routes_by_request_drops_strangers_and_forgets_finished() -> None:
    demux = EventDemux()
    a, b = demux.open("a"), demux.open("b")
    with pytest.raises(ValueError, match="already in flight"):
        demux.open("a")
    demux.deliver([_event("a", 1), _event("x", 9), _event("b", 1), _event("a", 2, "length")])
    assert [e.token_ids for e in [a.get_nowait(), a.get_nowait()]] == [[1], [2]]
    assert b.get_nowait().token_ids == [1] and len(demux) == 1  # "a" ended
    demux.deliver([_event("a", 3)])  # late events of a finished request go nowhere
    assert a.empty()
    demux.fail_all(ConnectionError("worker died"))
    with pytest.raises(ConnectionError, match="worker died"):
        await anext(read_stream(b))
    assert len(demux) == 0


async def test_demux_splits_a_steps_token_columns_into_each_open_requests_events() -> None:
    demux = EventDemux()
    a, b = demux.open("a"), demux.open("b")
    step = StepTokens(12.5, ["a", "x", "b"], [4, 9, 6], [3, 1, 5], [0, 0, 2])
    demux.deliver([step, _event("a", 5, "length")])
    assert a.get_nowait() == TokenEvent("a", [4], num_prompt_tokens=3, timestamp=12.5)
    assert a.get_nowait().finish_reason == "length" and a.empty()
    assert b.get_nowait() == TokenEvent(
        "b", [6], num_prompt_tokens=5, num_cached_tokens=2, timestamp=12.5
    )
    assert len(demux) == 1  # "b" is still open: a row of the columns never ends a request


async def test_a_worker_sends_each_step_of_all_its_requests_as_one_message(
    tmp_path: Path,
) -> None:
    write_checkpoint(tmp_path, "llama", "tiny")
    config = WorkerConfig(checkpoint=str(tmp_path), block_size=4, max_tokens=512)
    worker = GenerationWorker(config, "batches", "aggregated")
    num_requests, max_tokens = 4, 6
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    try:
        await worker.start()  # the engine idles: the four requests start in one step
        batches = worker.events()
        opened = await anext(batches)
        for i in range(num_requests):
            incarnation = await worker.submit(GenerationRequest(f"r{i}", [5 + i, 6, 7], params))
            # The stream names the incarnation that accepted the requests.
            assert opened == StreamOpened(incarnation)
        received: list[list[EventItem]] = []
        while sum(e.finished for batch in received for e in _events(batch)) < num_requests:
            batch = await anext(batches)
            assert isinstance(batch, list)
            received.append(batch)
    finally:
        await worker.shutdown()
    per_request = {f"r{i}": 0 for i in range(num_requests)}
    for batch in received:
        for event in _events(batch):
            per_request[event.request_id] += len(event.token_ids)
    assert per_request == {rid: max_tokens for rid in per_request}
    # The four requests share steps, so they share messages; a step's tokens
    # before the last travel as one set of columns.
    assert len(received) <= max_tokens + 1
    assert any(len({e.request_id for e in _events(batch)}) == num_requests for batch in received)
    steps = [item for batch in received for item in batch if isinstance(item, StepTokens)]
    assert any(sorted(step.request_ids) == sorted(per_request) for step in steps)
    finals = [item for batch in received for item in batch if isinstance(item, TokenEvent)]
    assert len(finals) == num_requests and all(e.finished for e in finals)


async def test_a_request_sent_after_a_new_stream_opened_has_no_event_on_the_old_one(
    tmp_path: Path,
) -> None:
    """An earlier `events()` call the router gave up on still runs on the
    worker; once the new call said its incarnation, it has taken over."""
    write_checkpoint(tmp_path, "llama", "tiny")
    config = WorkerConfig(checkpoint=str(tmp_path), block_size=4, max_tokens=512)
    worker = GenerationWorker(config, "takeover", "aggregated")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def read(stream: AsyncIterator[Any]) -> list[TokenEvent]:
        return [e async for batch in stream for e in _events(batch)]

    try:
        old = worker.events()
        await anext(old)
        abandoned = asyncio.ensure_future(read(old))
        new = worker.events()
        await anext(new)
        await worker.submit(GenerationRequest("r", [5, 6, 7], params))
        events: list[TokenEvent] = []
        while not events or not events[-1].finished:
            batch = await anext(new)
            assert isinstance(batch, list)
            events.extend(_events(batch))
        assert sum(len(e.token_ids) for e in events) == 4
        assert await asyncio.wait_for(abandoned, 5) == []
    finally:
        await worker.shutdown()


async def test_tokens_with_logprobs_travel_as_events_beside_the_columns(tmp_path: Path) -> None:
    """A request that asked for logprobs gets each token as a `TokenEvent`
    carrying them; the other request's tokens before its last are columns."""
    write_checkpoint(tmp_path, "llama", "tiny")
    config = WorkerConfig(checkpoint=str(tmp_path), block_size=4, max_tokens=512)
    worker = GenerationWorker(config, "logprobs", "aggregated")
    plain = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    scored = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2)
    try:
        await worker.start()
        batches = worker.events()
        await anext(batches)
        await worker.submit(GenerationRequest("plain", [5, 6, 7], plain))
        await worker.submit(GenerationRequest("scored", [5, 6, 7], scored))
        received: list[EventItem] = []
        while sum(e.finished for e in _events(received)) < 2:
            batch = await anext(batches)
            assert isinstance(batch, list)
            received += batch
    finally:
        await worker.shutdown()
    columns = [item for item in received if isinstance(item, StepTokens)]
    assert [rid for step in columns for rid in step.request_ids] == ["plain", "plain"]
    scored_events = [e for e in received if isinstance(e, TokenEvent) and e.request_id == "scored"]
    assert len(scored_events) == 3
    for event in scored_events:
        assert event.logprobs is not None and len(event.logprobs) == 1
        assert event.top_logprobs is not None and len(event.top_logprobs[0]) == 2
    assert [e.token_ids for e in _events(received) if e.request_id == "plain"] == [
        e.token_ids for e in scored_events
    ]
