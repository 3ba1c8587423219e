"""A worker's event socket hands its stream only to the connection that
presents a ticket it issued, and frames survive the trip whole."""

from __future__ import annotations

import asyncio

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
