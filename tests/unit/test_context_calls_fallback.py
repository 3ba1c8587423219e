"""A context worker whose call socket the router cannot reach still gets
its prefill calls, as Ray calls, and the router says so once."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cluster.routing import context_calls
from cluster.routing.context_calls import ContextCalls
from engine.event_socket import TICKET_BYTES, EventSocketOffer
from engine.messages import ContextRequest, ContextResult
from engine.sampling import SamplingParams


class _Method:
    def __init__(self, call: Any) -> None:
        self.remote = call


def _closed_port() -> int:
    """A loopback port nobody listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


class _UnreachableWorker:
    """Offers a call socket on a port nobody listens on; answers Ray calls."""

    def __init__(self) -> None:
        self.offers = 0
        self.call_socket = _Method(self._call_socket)
        self.prefill = _Method(self._prefill)

    async def _call_socket(self) -> AsyncIterator[asyncio.Future[EventSocketOffer]]:
        self.offers += 1
        offered: asyncio.Future[EventSocketOffer] = asyncio.get_running_loop().create_future()
        offered.set_result(EventSocketOffer("x", "127.0.0.1", _closed_port(), b"t" * TICKET_BYTES))
        yield offered

    async def _prefill(self, request: ContextRequest) -> ContextResult:
        return ContextResult(request.request_id, first_token_id=7)


async def test_an_unreachable_call_socket_leaves_the_calls_on_ray(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(context_calls, "_REOPEN_DELAY_S", 0.01)
    worker = _UnreachableWorker()
    calls = ContextCalls("context-0", worker)
    params = SamplingParams(max_tokens=1)
    try:
        with caplog.at_level(logging.WARNING, logger="cluster.routing.context_calls"):
            for n in range(3):
                result = await calls.prefill(ContextRequest(f"r{n}", [1, 2], params))
                assert result.request_id == f"r{n}" and result.first_token_id == 7
                while calls._reader is not None:  # the socket's attempt ends
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.02)  # past the reopen delay
    finally:
        await calls.stop()
    assert worker.offers == 3  # each call after the delay tried the socket again
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "cannot reach the context worker's socket" in warnings[0]


async def test_connect_tries_the_socket_before_the_first_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Start-up connects; a socket it cannot reach leaves the calls on Ray."""
    worker = _UnreachableWorker()
    calls = ContextCalls("context-0", worker)
    try:
        with caplog.at_level(logging.WARNING, logger="cluster.routing.context_calls"):
            await asyncio.wait_for(calls.connect(), 10)
        assert worker.offers == 1 and calls._reader is None
        result = await calls.prefill(ContextRequest("r0", [1, 2], SamplingParams(max_tokens=1)))
        assert result.first_token_id == 7
    finally:
        await calls.stop()
