"""The router's `prefill` calls to one context worker.

A Ray call each way between the router and a context worker busy
prefilling (its dispatch, its return) took a few times what a frame on a
socket takes, an eighth of a 1P1D request's time to its first token
(docs/performance.md, "Serving path"). So the calls go as frames on a socket the
worker offers (`ContextWorker.call_socket`, `engine.event_socket.serve_calls`,
`cluster.routing.worker_socket`): a call is `(call id, request)`, the answer
`(call id, ok, result or exception)`, and a caller that leaves (the client
went away, the router gave up on the worker) sends `(call id, None)`, which
cancels the prefill there as a cancelled Ray call would.

While no socket is open (the first call, after a break, while the worker
restarts) a call goes as a plain Ray call and the socket is (re)opened in
the background, at most once per `_REOPEN_DELAY_S`. A socket that breaks
fails the calls waiting on it with what broke it: Ray's news of the
worker's death (`RayActorError`), as a Ray call to a dead worker fails, or
`StreamBrokenError`; the router retries those on another context worker.
A socket the router cannot reach (a firewall between the nodes) is logged
once, and the calls keep going through Ray.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

from cluster.routing.worker_socket import StreamBrokenError, WorkerSocket, open_worker_socket
from engine.messages import ContextRequest, ContextResult
from runtime.cancellation import cancel_and_wait

logger = logging.getLogger(__name__)

_REOPEN_DELAY_S = 0.5
_CONNECT_POLL_S = 0.01


class ContextCalls:
    def __init__(self, name: str, actor: Any) -> None:
        self.name = name
        self.actor = actor  # a Ray ActorHandle of a context worker
        self._socket: WorkerSocket | None = None
        self._reader: asyncio.Task[None] | None = None  # opens and reads the socket
        self._next_open = 0.0  # monotonic: no (re)open before then
        self._answers: dict[int, asyncio.Future[ContextResult]] = {}
        self._call_ids = itertools.count()
        self._warned = False

    async def prefill(self, request: ContextRequest) -> ContextResult:
        """The worker's `prefill(request)`: its result, or what it raised."""
        socket = self._socket
        if socket is None:
            self._open_soon()
            result: ContextResult = await self.actor.prefill.remote(request)
            return result
        call_id = next(self._call_ids)
        answer: asyncio.Future[ContextResult] = asyncio.get_running_loop().create_future()
        self._answers[call_id] = answer
        socket.send((call_id, request))
        try:
            return await answer
        except asyncio.CancelledError:
            if self._socket is socket:
                socket.send((call_id, None))  # cancels the prefill there
            raise
        finally:
            self._answers.pop(call_id, None)

    async def connect(self) -> None:
        """Open the call socket now, as the first call would, and return once
        it is open or its opening failed (calls then go through Ray, as
        before): start-up does this, so that no request pays for the opening."""
        self._open_soon()
        while self._socket is None and self._reader is not None:
            await asyncio.sleep(_CONNECT_POLL_S)

    async def stop(self) -> None:
        """Close the socket; calls waiting on it get `StreamBrokenError`."""
        try:
            await cancel_and_wait(self._reader)
        finally:
            self._next_open = float("inf")
            self._fail(StreamBrokenError(f"the router stopped calling {self.name}"))

    def _open_soon(self) -> None:
        if self._reader is None and time.monotonic() >= self._next_open:
            self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        """Open the worker's call socket and settle the answers read from it
        until it breaks; then fail the calls still waiting on it."""
        error: BaseException = StreamBrokenError(f"the call socket of {self.name} closed")
        opened = False
        try:
            async with open_worker_socket(self.actor.call_socket.remote(), "context") as socket:
                self._socket, opened = socket, True
                async for call_id, ok, value in socket.frames():
                    answer = self._answers.get(call_id)
                    if answer is None or answer.done():
                        continue  # its caller left
                    if ok:
                        answer.set_result(value)
                    else:
                        answer.set_exception(value)
        except asyncio.CancelledError:
            error = StreamBrokenError(f"the router stopped calling {self.name}")
            raise
        except Exception as exc:  # a dead worker (Ray's news), a closed socket
            error = exc
            if not opened and isinstance(exc, StreamBrokenError) and not self._warned:
                self._warned = True  # an unreachable socket stays so: say it once
                logger.warning("%s: %s; prefill calls go as Ray calls", self.name, exc)
        finally:
            self._socket = None
            self._reader = None
            self._next_open = time.monotonic() + _REOPEN_DELAY_S
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
        for answer in self._answers.values():
            if not answer.done():
                answer.set_exception(error)
