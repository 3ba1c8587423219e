"""The router's channel to a generation worker fails exactly the requests a
broken event stream took with it, across worker restarts.

The worker side is scripted: which incarnation of the worker answers calls
now, and each event stream the channel opens is a queue the test feeds (an
item, or an exception that breaks the stream as a dead actor's would). A
stream that opens with `SocketOpened` takes the bursts of requests itself,
and the test answers each with its receipt in the stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from cluster.routing.worker_channel import SocketOpened, StreamBrokenError, WorkerChannel
from cluster.routing.worker_poller import UnresponsiveWorkerError
from engine.errors import RequestFailedError
from engine.event_stream import StreamOpened
from engine.messages import GenerationRequest, SubmitReceipt, TokenEvent
from engine.sampling import SamplingParams


class _Method:
    def __init__(self, call: Callable[..., Any]) -> None:
        self.remote = call


class _Worker:
    """The calls `WorkerChannel` makes on a generation worker's actor handle."""

    def __init__(self, incarnation: str) -> None:
        self.running = incarnation  # the incarnation that answers calls now
        self.streams: asyncio.Queue[asyncio.Queue[Any]] = asyncio.Queue()
        self.aborts: list[tuple[str, bool]] = []
        self.submitted: list[str] = []
        self.calls: list[list[str]] = []  # request ids per submit call
        self.in_flight = 0  # submit calls not answered yet
        self.refuse: set[str] = set()  # ids answered as already in flight
        self.answer = asyncio.Event()  # cleared: submit calls wait until it is set
        self.answer.set()
        self.submit_many = _Method(self._submit_many)
        self.abort = _Method(lambda rid, remember=True: self.aborts.append((rid, remember)))

    async def _submit_many(self, requests: list[GenerationRequest]) -> SubmitReceipt:
        self.in_flight += 1
        try:
            assert self.in_flight == 1, "two submit calls in flight to one worker"
            ids = [r.request_id for r in requests]
            self.calls.append(ids)
            self.submitted.extend(ids)
            await self.answer.wait()
            refused = {rid: "already in flight" for rid in ids if rid in self.refuse}
            return SubmitReceipt(self.running, refused)
        finally:
            self.in_flight -= 1

    def open_stream(self) -> AsyncGenerator[Any, None]:
        """The channel's `open_stream`: a new stream, fed through `streams`."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.streams.put_nowait(queue)
        return self._stream(queue)

    async def _stream(self, queue: asyncio.Queue[Any]) -> AsyncGenerator[Any, None]:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item


def _channel(worker: _Worker) -> WorkerChannel:
    return WorkerChannel("generation-0", worker, open_stream=_Worker.open_stream)


def _request(request_id: str) -> GenerationRequest:
    return GenerationRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=1))


def _final(request_id: str) -> list[TokenEvent]:
    return [TokenEvent(request_id, [7], finish_reason="length")]


def _started(channel: WorkerChannel, request_id: str) -> asyncio.Future[TokenEvent]:
    """Start a request on `channel`; the future is its first event."""
    return asyncio.ensure_future(anext(channel.stream(_request(request_id))))


async def _in_call(
    worker: _Worker, channel: WorkerChannel, request_id: str
) -> asyncio.Future[TokenEvent]:
    """`_started`, returning once a submit call carrying that request alone
    is in flight (with `worker.answer` cleared, it stays so)."""
    first = _started(channel, request_id)
    while worker.calls[-1] != [request_id]:
        await asyncio.sleep(0.01)
    return first


async def _submitted(channel: WorkerChannel, request_id: str) -> asyncio.Future[TokenEvent]:
    """`_started`, returning once the worker accepted the request."""
    first = _started(channel, request_id)
    while request_id not in channel._submitted_to:  # the submit came back
        assert not first.done(), first
        await asyncio.sleep(0.01)
    return first


async def _opened(worker: _Worker, channel: WorkerChannel, incarnation: str) -> asyncio.Queue[Any]:
    """Run one request through `channel`, so its stream is open and has said it
    comes from `incarnation`; returns that stream's feed."""
    first = _started(channel, "warm")
    stream = await worker.streams.get()
    stream.put_nowait(StreamOpened(incarnation))
    stream.put_nowait(_final("warm"))
    await first
    return stream


async def _sent_once_open(
    worker: _Worker, stream: asyncio.Queue[Any], first: asyncio.Future[TokenEvent]
) -> None:
    """`stream` opens (incarnation "a"): the waiting request "r1" is sent then,
    and its events arrive on that stream."""
    stream.put_nowait(StreamOpened("a"))
    while worker.submitted != ["r1"]:
        await asyncio.sleep(0.01)
    stream.put_nowait(_final("r1"))
    assert (await first).token_ids == [7]


async def test_a_stale_stream_breaking_late_spares_requests_on_the_restarted_worker() -> None:
    worker = _Worker("old")
    channel = _channel(worker)
    try:
        old = await _opened(worker, channel, "old")
        worker.running = "new"  # Ray restarted the worker; the old stream has not failed yet
        first = await _submitted(channel, "r1")
        old.put_nowait(ConnectionError("the old instance died"))
        new = await worker.streams.get()
        assert not first.done()
        new.put_nowait(StreamOpened("new"))
        new.put_nowait(_final("r1"))
        assert (await first).token_ids == [7]
        assert worker.aborts == []
    finally:
        await channel.stop()


async def test_a_request_is_sent_only_once_the_stream_said_its_incarnation() -> None:
    """Until then an earlier call the router gave up on may still read the
    worker's events, and could take this request's."""
    worker = _Worker("a")
    channel = _channel(worker)
    try:
        first = _started(channel, "r1")
        stream = await worker.streams.get()
        await asyncio.sleep(0.05)
        assert worker.submitted == [] and not first.done()
        await _sent_once_open(worker, stream, first)
    finally:
        await channel.stop()


async def test_a_broken_stream_fails_the_requests_of_its_incarnation() -> None:
    worker = _Worker("a")
    channel = _channel(worker)
    try:
        stream = await _opened(worker, channel, "a")
        first = await _submitted(channel, "r1")
        stream.put_nowait(ConnectionError("a died"))
        with pytest.raises(ConnectionError, match="a died"):
            await first
        # The request may still run there: it is cancelled, not remembered.
        assert worker.aborts == [("r1", False)]
    finally:
        await channel.stop()


async def test_a_stream_from_a_new_incarnation_fails_the_old_ones_requests() -> None:
    worker = _Worker("z")
    channel = _channel(worker)
    try:
        old = await _opened(worker, channel, "z")
        worker.running = "a"  # restarted; the stream of "z" has not failed yet
        first = await _submitted(channel, "r1")
        old.put_nowait(ConnectionError("z died"))  # spares r1: "a" accepted it
        worker.running = "b"  # "a" died too, before the stream reopened
        (await worker.streams.get()).put_nowait(StreamOpened("b"))
        with pytest.raises(StreamBrokenError, match="restarted"):
            await first
    finally:
        await channel.stop()


async def test_a_request_waiting_for_its_stream_outlives_a_break_and_is_sent_on_the_next() -> None:
    """A worker that restarts breaks the stream before the new one opens; a
    request not sent yet lost nothing, so it waits for that new stream."""
    worker = _Worker("a")
    channel = _channel(worker)
    try:
        first = _started(channel, "r1")
        (await worker.streams.get()).put_nowait(ConnectionError("the actor is restarting"))
        stream = await worker.streams.get()
        assert worker.submitted == [] and not first.done()
        await _sent_once_open(worker, stream, first)
    finally:
        await channel.stop()


async def test_a_stream_call_failing_during_a_restart_keeps_waiting_requests_waiting() -> None:
    """Stream calls made while Ray restarts the worker fail as temporarily
    unavailable, the last one at times after the new instance answers polls:
    a request that arrived meanwhile waits for the stream that opens next."""
    worker = _Worker("a")
    channel = _channel(worker)
    try:
        first = _started(channel, "r1")
        for _ in range(2):
            restarting = ActorUnavailableError("IOError: The actor is restarting.", None)
            (await worker.streams.get()).put_nowait(restarting)
        stream = await worker.streams.get()
        assert worker.submitted == [] and not first.done()
        await _sent_once_open(worker, stream, first)
    finally:
        await channel.stop()


async def test_a_worker_that_died_fails_the_requests_waiting_to_be_sent_at_once() -> None:
    """A break saying the worker died fails a request not sent yet with that
    error, so the router can route it to another worker instead of waiting
    for the restart; a request arriving after the break waits for the
    reopened stream."""
    worker = _Worker("a")
    channel = _channel(worker)
    try:
        first = _started(channel, "r1")
        (await worker.streams.get()).put_nowait(ActorDiedError())
        with pytest.raises(ActorDiedError):
            await asyncio.wait_for(first, 5)
        assert worker.submitted == []
        later = _started(channel, "r1")
        stream = await worker.streams.get()
        await asyncio.sleep(0.05)
        assert not later.done()
        await _sent_once_open(worker, stream, later)
    finally:
        await channel.stop()


@pytest.mark.parametrize(
    "death",
    [ActorDiedError(), ActorUnavailableError("RpcError: Socket closed", None)],
    ids=["died", "unavailable"],
)
async def test_a_worker_that_died_fails_the_requests_queued_for_its_next_call(
    death: Exception,
) -> None:
    """Requests queued behind a submit call when the open stream breaks with
    the worker's death fail with it, not wait for the restarted worker; also
    when Ray calls the worker temporarily unavailable (its node died): from a
    stream that had opened, that is news of its death too."""
    worker = _Worker("a")
    channel = _channel(worker)
    try:
        stream = await _opened(worker, channel, "a")
        worker.answer.clear()  # submit calls stay in flight
        await _in_call(worker, channel, "r0")
        queued = _started(channel, "r1")
        while "r1" not in channel._outgoing:
            await asyncio.sleep(0.01)
        stream.put_nowait(death)
        with pytest.raises(type(death)):
            await asyncio.wait_for(queued, 5)
        assert worker.calls == [["warm"], ["r0"]]
    finally:
        worker.answer.set()
        await channel.stop()


async def test_giving_up_on_a_silent_worker_fails_what_it_accepted_or_is_being_sent() -> None:
    """`fail_sent`: the accepted request and the one in the submit call fail
    and are aborted on the worker (the one in the call remembered there, as
    the call may reach it later); a request queued behind that call fails
    without an abort (it never went); a later request goes in the next call."""
    worker = _Worker("a")
    channel = _channel(worker)
    try:
        stream = await _opened(worker, channel, "a")
        accepted = await _submitted(channel, "r0")
        worker.answer.clear()  # submit calls stay in flight
        in_call = await _in_call(worker, channel, "r1")
        queued = _started(channel, "r2")
        while "r2" not in channel._outgoing:
            await asyncio.sleep(0.01)
        channel.fail_sent(UnresponsiveWorkerError("generation-0 answered nothing for 30 s"))
        for first in (accepted, in_call, queued):
            with pytest.raises(UnresponsiveWorkerError, match="answered nothing"):
                await asyncio.wait_for(first, 5)
        assert sorted(worker.aborts) == [("r0", False), ("r1", True)]
        worker.answer.set()  # the worker is back: a new request goes in the next call
        later = _started(channel, "r3")
        while "r3" not in worker.submitted:
            await asyncio.sleep(0.01)
        stream.put_nowait(_final("r3"))
        assert (await asyncio.wait_for(later, 5)).token_ids == [7]
        assert "r2" not in worker.submitted
    finally:
        worker.answer.set()
        await channel.stop()


async def test_a_submit_answered_by_a_replaced_incarnation_fails_at_once() -> None:
    worker = _Worker("a")
    channel = _channel(worker)
    try:
        stream = await _opened(worker, channel, "a")
        stream.put_nowait(ConnectionError("a died"))
        (await worker.streams.get()).put_nowait(StreamOpened("b"))  # "a" is gone
        while channel._reading != "b":
            await asyncio.sleep(0.01)
        # A submit that reached "a" before it died: its events went with it.
        with pytest.raises(StreamBrokenError, match="restarted after it accepted"):
            await anext(channel.stream(_request("r1")))
    finally:
        await channel.stop()


async def test_requests_arriving_during_a_submit_call_go_together_in_the_next() -> None:
    worker = _Worker("a")
    channel = _channel(worker)
    try:
        stream = await _opened(worker, channel, "a")
        worker.answer.clear()  # submit calls stay in flight
        ids = [f"r{i}" for i in range(8)]
        firsts = [await _in_call(worker, channel, ids[0])]
        firsts += [_started(channel, r) for r in ids[1:]]
        await asyncio.sleep(0.05)
        assert worker.calls == [["warm"], ["r0"]]  # the others wait for r0's call
        worker.answer.set()
        while len(worker.submitted) < 1 + len(ids):
            await asyncio.sleep(0.01)
        assert worker.calls == [["warm"], ["r0"], ids[1:]]
        for i, rid in enumerate(ids):
            stream.put_nowait([TokenEvent(rid, [i], finish_reason="length")])
        assert [(await first).token_ids for first in firsts] == [[i] for i in range(8)]
    finally:
        await channel.stop()


async def test_a_refused_request_fails_alone() -> None:
    worker = _Worker("a")
    channel = _channel(worker)
    try:
        stream = await _opened(worker, channel, "a")
        worker.refuse.add("dup")
        worker.answer.clear()
        firsts = {r: _started(channel, r) for r in "xy"}
        refused = _started(channel, "dup")
        await asyncio.sleep(0.05)
        worker.answer.set()
        with pytest.raises(RequestFailedError, match="already in flight"):
            await refused
        assert worker.calls[-1] == ["x", "y", "dup"]
        stream.put_nowait(_final("x") + _final("y"))
        assert [(await f).token_ids for f in firsts.values()] == [[7], [7]]
        assert worker.aborts == []  # a refused request never ran there
    finally:
        await channel.stop()


async def test_stop_fails_requests_still_waiting_to_be_sent() -> None:
    worker = _Worker("a")
    channel = _channel(worker)
    await _opened(worker, channel, "a")
    worker.answer.clear()
    in_call = await _in_call(worker, channel, "r1")
    queued = _started(channel, "r2")
    await asyncio.sleep(0.05)
    assert worker.submitted == ["warm", "r1"]  # r2 waits for r1's call
    await channel.stop()
    for first in (in_call, queued):
        with pytest.raises(StreamBrokenError, match="stopped"):
            await asyncio.wait_for(first, 5)
    assert worker.submitted == ["warm", "r1"]


async def test_a_request_whose_caller_left_before_its_call_is_not_sent() -> None:
    worker = _Worker("a")
    channel = _channel(worker)
    try:
        await _opened(worker, channel, "a")
        worker.answer.clear()
        in_call = await _in_call(worker, channel, "r1")
        gone = _started(channel, "gone")
        kept = _started(channel, "kept")
        await asyncio.sleep(0.05)
        gone.cancel()
        worker.answer.set()
        while worker.calls[-1] != ["kept"]:
            await asyncio.sleep(0.01)
        assert "gone" not in worker.submitted
        in_call.cancel()
        kept.cancel()
    finally:
        await channel.stop()


async def _burst_sent(sent: list[list[GenerationRequest]], ids: list[str]) -> None:
    for _ in range(500):
        if [[r.request_id for r in burst] for burst in sent] == [ids]:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"bursts sent: {sent}")


async def test_a_burst_goes_on_the_socket_and_its_receipt_settles_it() -> None:
    worker = _Worker("a")
    channel = _channel(worker)
    try:
        first, refused = _started(channel, "r1"), _started(channel, "r2")
        stream = await worker.streams.get()
        sent: list[list[GenerationRequest]] = []
        stream.put_nowait(SocketOpened("a", sent.append))
        await _burst_sent(sent, ["r1", "r2"])
        assert worker.calls == []  # no Ray call
        stream.put_nowait(SubmitReceipt("a", {"r2": "already in flight"}))
        with pytest.raises(RequestFailedError, match="already in flight"):
            await asyncio.wait_for(refused, 5.0)
        stream.put_nowait(_final("r1"))
        assert (await asyncio.wait_for(first, 5.0)).token_ids == [7]
        assert channel._submitted_to == {"r1": "a"}
    finally:
        await channel.stop()


async def test_a_socket_that_breaks_before_the_receipt_fails_the_burst_and_aborts_it() -> None:
    worker = _Worker("a")
    channel = _channel(worker)
    try:
        first = _started(channel, "r1")
        stream = await worker.streams.get()
        sent: list[list[GenerationRequest]] = []
        stream.put_nowait(SocketOpened("a", sent.append))
        await _burst_sent(sent, ["r1"])
        stream.put_nowait(StreamBrokenError("the socket closed"))
        with pytest.raises(StreamBrokenError, match="the socket closed"):
            await asyncio.wait_for(first, 5.0)
        # It may have reached a worker that lives on; nothing of it comes later.
        assert worker.aborts == [("r1", False)]
        # The next stream cannot carry bursts: they go as Ray calls again.
        second = _started(channel, "r3")
        (await asyncio.wait_for(worker.streams.get(), 5.0)).put_nowait(StreamOpened("a"))
        for _ in range(500):
            if worker.calls == [["r3"]]:
                break
            await asyncio.sleep(0.01)
        assert worker.calls == [["r3"]]
    finally:
        await channel.stop()
    with pytest.raises(StreamBrokenError, match="stopped reading"):
        await second


async def test_stop_ends_the_reader_even_when_a_stream_swallows_the_cancel() -> None:
    """A stream whose code eats the stop's `CancelledError` and ends (as
    Python 3.11's `wait_for` can when its future finishes as the cancel
    arrives) must not leave the reader reopening streams forever."""
    opened = 0

    async def swallowing(actor: Any) -> AsyncGenerator[Any, None]:
        nonlocal opened
        opened += 1
        yield StreamOpened("inc-1")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return  # swallowed: the stream just ends

    channel = WorkerChannel("generation-0", _Worker("inc-1"), open_stream=swallowing)
    channel._start()
    reader = channel._reader
    assert reader is not None
    async with asyncio.timeout(5):
        while opened == 0:
            await asyncio.sleep(0.01)
    stopping = asyncio.ensure_future(channel.stop())
    done, _ = await asyncio.wait({stopping}, timeout=5)
    if not done:  # the reader reopens every 0.2 s: end it by force, then fail
        while not reader.done():
            reader.cancel()
            await asyncio.sleep(0.05)
        await stopping
        pytest.fail("stop() did not end the reader: it reopened after a swallowed cancel")
    await asyncio.sleep(0.5)
    assert opened == 1


async def test_connect_opens_the_stream_before_any_request() -> None:
    """Start-up connects: the first request then finds the stream open."""
    worker = _Worker("a")
    channel = _channel(worker)
    try:
        connecting = asyncio.ensure_future(channel.connect())
        stream = await asyncio.wait_for(worker.streams.get(), 5)
        await asyncio.sleep(0.01)
        assert not connecting.done()  # it waits for the stream to say its incarnation
        stream.put_nowait(StreamOpened("a"))
        await asyncio.wait_for(connecting, 5)
        assert worker.streams.empty() and not worker.submitted
    finally:
        await channel.stop()
