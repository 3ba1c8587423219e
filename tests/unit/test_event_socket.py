"""A worker's event socket hands its stream only to the connection that
presents a ticket it issued, and frames survive the trip whole; calls on a
socket are answered (a result, an exception, one that does not pickle),
cancelled by their caller, and cancelled when the caller goes away."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine import event_socket
from engine.event_socket import EventListener, frame, read_frame
from engine.messages import StepTokens, TokenEvent


async def _eof(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(), 5.0) == b""


async def test_only_the_ticket_holder_gets_the_connection() -> None:
    listener = EventListener("127.0.0.1")
    await listener.start()
    try:
        ticket, connected = listener.issue()
        reader, writer = await asyncio.open_connection(listener.host, listener.port)
        writer.write(b"x" * len(ticket))  # a guess
        assert await _eof(reader)  # closed unanswered
        assert not connected.done()
        reader, writer = await asyncio.open_connection(listener.host, listener.port)
        writer.write(ticket)
        server_reader, server_writer = await asyncio.wait_for(connected, 5.0)
        # The ticket is spent: presenting it again gets nothing.
        again_reader, again_writer = await asyncio.open_connection(listener.host, listener.port)
        again_writer.write(ticket)
        assert await _eof(again_reader)
        batches = [
            [TokenEvent("a", [1, 2], finish_reason="length")],
            [StepTokens(1.5, ["a", "b"], [3, 4]), TokenEvent("b", [], error="x")],
        ]
        for batch in batches:
            server_writer.write(frame(batch))
        server_writer.close()
        assert [await read_frame(reader) for _ in batches] == batches
        with pytest.raises(asyncio.IncompleteReadError):
            await read_frame(reader)
        for w in (writer, again_writer):
            w.close()
    finally:
        await listener.close()


async def test_a_connection_that_says_nothing_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(event_socket, "TICKET_TIMEOUT_S", 0.1)
    listener = EventListener("127.0.0.1")
    await listener.start()
    try:
        _, connected = listener.issue()
        reader, writer = await asyncio.open_connection(listener.host, listener.port)
        assert await _eof(reader)
        assert not connected.done()
        writer.close()
    finally:
        await listener.close()
    assert connected.cancelled()  # closing the listener ends the offers still open


class _Unpicklable(Exception):
    def __reduce__(self) -> Any:
        raise TypeError("not this one")


async def test_calls_are_answered_cancelled_and_ended_with_the_connection() -> None:
    started: dict[str, asyncio.Event] = {}
    cancelled: list[str] = []

    async def handler(arg: str) -> str:
        if arg == "fails":
            raise ValueError("no such thing")
        if arg == "unpicklable":
            raise _Unpicklable("odd")
        if arg == "echo":
            return arg.upper()
        started[arg] = asyncio.Event()
        started[arg].set()
        try:
            await asyncio.Event().wait()  # runs until cancelled
        except asyncio.CancelledError:
            cancelled.append(arg)
            raise
        return arg

    served: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await event_socket.serve_calls(reader, writer, handler)
        served.set_result(None)

    server = await asyncio.start_server(accepted, "127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
        for call in [(1, "slow-1"), (2, "echo"), (3, "fails"), (4, "unpicklable"), (5, "slow-5")]:
            writer.write(frame(call))
        answers = {}
        for _ in range(3):
            call_id, ok, value = await asyncio.wait_for(read_frame(reader), 5.0)
            answers[call_id] = (ok, value)
        assert answers[2] == (True, "ECHO")
        assert answers[3][0] is False and isinstance(answers[3][1], ValueError)
        assert answers[4][0] is False and "_Unpicklable: odd" in str(answers[4][1])
        writer.write(frame((1, None)))  # the caller of call 1 left
        while cancelled != ["slow-1"]:
            await asyncio.sleep(0.01)
        writer.close()  # the caller went away: call 5 is cancelled too
        await asyncio.wait_for(served, 5.0)
        assert cancelled == ["slow-1", "slow-5"]
    finally:
        server.close()
