"""Drive an `EngineCore` from an actor's asyncio loop.

Each step's model runs on the process's compute thread (`engine.threads`),
so the actor keeps answering calls (new requests, aborts, load reports,
transfers) while the model computes; its scheduling and its update run on
the event loop, so the scheduler and the cache manager only ever see one
thread. Every mutation of engine state — adding, aborting, freeing a
handed-off request — is queued with `call_between_steps` and applied while
no step is running. Taking free blocks for a new request (a pull's
destination) may run at once instead (`run_beside_step`): the model in
flight reads only its scheduled requests.

    event loop:   apply queued | schedule |     (free)     | update, send events | apply ...
    compute:                              |--- the model --|

Token events leave through one callback per step (`on_events`) with every
request's new tokens of that step (the plain ones as one `StepTokens`),
never one call per token.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from engine.core import EngineCore, StepResult
from engine.messages import EventItem, TokenEvent
from engine.request import Request
from engine.step_timeline import StepTimeline, timed_call
from engine.threads import compute_executor
from runtime.cancellation import wait_ended
from runtime.startup_heap import freeze_startup_heap

logger = logging.getLogger(__name__)

T = TypeVar("T")

# When work is queued but nothing could be scheduled (all blocks pinned by
# handoffs or pulls), retry after this long instead of spinning.
_BLOCKED_RETRY_S = 0.005
# A worker whose engine loop died lives this long before it exits for a
# restart (`exit_for_restart`), with this status.
EXIT_GRACE_S = 1.0
EXIT_CODE_ENGINE_DIED = 70
# The error of a request open when the loop stops, or submitted after.
_SHUTTING_DOWN = "the worker is shutting down; retry on another worker"


@dataclass
class StepStats:
    """Running totals for load reports and the per-step breakdown."""

    steps: int = 0
    tokens: int = 0
    busy_s: float = 0.0  # wall time from handing each step to the compute thread to its result
    preemptions: int = 0
    handed_back: int = 0
    schedule_s: float = 0.0
    build_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0

    def add(self, result: StepResult) -> None:
        self.steps += 1
        self.tokens += result.num_tokens
        self.preemptions += result.num_preempted
        self.handed_back += result.num_handed_back
        self.schedule_s += result.schedule_s
        self.build_s += result.timings.build_s
        self.forward_s += result.timings.forward_s
        self.sample_s += result.timings.sample_s


class EngineLoop:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.stats = StepStats()
        self.timeline = StepTimeline()
        self.on_handoff: Callable[[Request], None] | None = None
        # Sees every step's result before its handoffs (between steps).
        self.on_step: Callable[[StepResult], None] | None = None
        # Receives each step's events in one list; set before `start`.
        self.on_events: Callable[[list[EventItem]], None] = _drop
        # Called once the loop has died (its open streams already failed); a
        # worker process sets `exit_for_restart`, as a dead loop never steps
        # again and would leave every later request waiting.
        self.on_death: Callable[[BaseException], None] = _ignore
        self._open: set[str] = set()  # submitted, final event not yet sent
        self._pending: list[Callable[[], None]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._stopping = False
        self._computing_since: float | None = None  # monotonic start of the model in flight

    def start(self) -> None:
        if self._task is None:
            freeze_startup_heap()  # the model is loaded: what exists now lives on
            self.timeline.gc.install()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop at the next step boundary (a step in flight finishes first),
        apply every queued mutation, and end open streams with an error."""
        if self._task is None:
            return
        self._stopping = True
        self._wake.set()
        task = self._task
        try:
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError:
                task.cancel()  # the caller stopped waiting for the step boundary
                await wait_ended(task)
                raise
        finally:
            if task.done() and not task.cancelled():
                task.exception()  # a loop that died was logged and failed its streams
            self._task = None
            self._apply_pending()
            self._fail_open_streams(_SHUTTING_DOWN)

    @property
    def step_in_flight_s(self) -> float:
        """How long the model has computed the step in flight (0 between steps).

        Load reports carry it, so the router tells a compute thread that hangs
        (a collective that never returns, a wedged device) from a busy one.
        """
        since = self._computing_since
        return 0.0 if since is None else time.monotonic() - since

    @property
    def healthy(self) -> bool:
        return self._error is None and (self._task is None or not self._task.done())

    def call_between_steps(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the event loop when no step is in flight: at once when
        the loop has stopped or died, as no step will ever run again (queued,
        it would wait for ever: a dead loop's worker answers `integrity()`
        and aborts until it exits)."""
        if (self._stopping and self._task is None) or self._error is not None:
            fn()
            return
        self._pending.append(fn)
        self._wake.set()

    def run_beside_step(self, fn: Callable[[], T]) -> T:
        """Run `fn` now, even while a step's model computes, and return its result.

        Only for `fn` that touches no request of a step in flight, such as
        allocating free blocks (and a Mamba slot) to a request not yet
        submitted: a step's scheduling and update run on this event loop,
        never at the same time as `fn`, and its model reads and writes only
        the scheduled requests' blocks and slots (`EngineCore.execute`).
        """
        return fn()

    async def run_between_steps(self, fn: Callable[[], T]) -> T:
        """Run `fn` like `call_between_steps` and return its result (or raise its error).

        `fn` runs even if the caller is cancelled meanwhile (its result is then
        dropped): callers free what `fn` allocated by the request id anyway, and
        a cancelled waiter must never break the engine loop.
        """
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()

        def run() -> None:
            try:
                result = fn()
            except Exception as exc:
                if not future.done():
                    future.set_exception(exc)
                return
            if not future.done():
                future.set_result(result)

        self.call_between_steps(run)
        return await future

    def submit(
        self,
        request: Request,
        prefilled: bool = False,
        prepare: Callable[[], None] | None = None,
    ) -> None:
        """Queue a request; its `TokenEvent`s go to `on_events`.

        `prefilled` admits it straight into the running batch (its cache was
        pulled). `prepare` runs between steps right before the request joins,
        in the same gap (marking a pulled cache complete costs no extra step).
        Raises ValueError for an id already in flight; capacity errors and an
        error of `prepare` surface as a final event with `error` set (after
        a failed `prepare` the request's blocks and slot are freed). A loop
        that died takes no request (its pulled blocks and slot are freed); one
        that is stopping or stopped ends it with an error event at once (and
        frees them too).
        """
        if request.request_id in self._open:
            raise ValueError(f"request id {request.request_id!r} is already in flight here")
        self._open.add(request.request_id)

        def add() -> None:
            if self._error is not None:
                # The loop died: no step would run it. Its stream stays open
                # until `on_death` ends the process, and the router reruns a
                # request whose worker died before it streamed a token (an
                # error event here would end an aggregated request instead).
                if prefilled:
                    self.core.free_cache(request.request_id)
                return
            if self._stopping:  # no step will run it; the router reruns it elsewhere
                if prefilled:
                    self.core.free_cache(request.request_id)
                self._emit([_error_event(request, _SHUTTING_DOWN)])
                return
            try:
                if prepare is not None:
                    prepare()
            except Exception as exc:  # the pulled cache never joins: free it
                self.core.free_cache(request.request_id)
                self._emit([_error_event(request, str(exc))])
                return
            try:
                if prefilled:
                    self.core.add_prefilled(request)
                else:
                    self.core.add(request)
            except Exception as exc:  # CapacityError or a duplicate id
                self._emit([_error_event(request, str(exc))])

        self.call_between_steps(add)

    def abort(self, request_id: str) -> None:
        """Cancel a request; its stream gets a final "abort" event."""

        def drop() -> None:
            request = self.core.abort(request_id)
            if request is not None:
                self._emit([TokenEvent.ended(request_id, "abort")])

        self.call_between_steps(drop)

    async def _run(self) -> None:
        try:
            while not self._stopping:
                self._apply_pending()
                if not self.core.has_work():
                    self._wake.clear()
                    if not self._pending:
                        idle_from = time.perf_counter()
                        await self._wake.wait()
                        self.timeline.idled(time.perf_counter() - idle_from)
                    continue
                result = await self._step()
                self.stats.add(result)
                self._dispatch(result)
                if result.num_tokens == 0 and not (result.events or result.tokens):
                    await asyncio.sleep(_BLOCKED_RETRY_S)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._error = exc
            logger.exception("engine loop died; failing every request in flight")
            self._fail_open_streams(f"engine failed: {exc!r}")
            self.on_death(exc)
            self._apply_pending_after_death()
            raise

    async def _step(self) -> StepResult:
        """Schedule here, run the model on the compute thread, update here."""
        started = self.timeline.starting()
        plan = self.core.schedule()
        if plan.is_empty:
            return plan.result
        self._computing_since = time.monotonic()
        try:
            out, timing = await asyncio.get_running_loop().run_in_executor(
                compute_executor(), timed_call, partial(self.core.execute, plan)
            )
        finally:
            self._computing_since = None
        result = self.core.update(plan, out)
        self.stats.busy_s += time.perf_counter() - started
        self.timeline.stepped(started, timing, result.num_seqs, result.num_tokens)
        return result

    def _fail_open_streams(self, error: str) -> None:
        """End every stream still open with a final error event."""
        self._emit([TokenEvent.ended(request_id, "error", error) for request_id in self._open])

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        started = time.perf_counter()
        for fn in pending:
            fn()
        if pending:
            self.timeline.applied(len(pending), time.perf_counter() - started)

    def _apply_pending_after_death(self) -> None:
        """Run the calls queued before the loop died (later ones run at once):
        no step will run them, and their callers wait. One that fails is
        logged; the rest still run."""
        pending, self._pending = self._pending, []
        for fn in pending:
            try:
                fn()
            except Exception:
                logger.exception("a call queued before the engine loop died failed")

    def _dispatch(self, result: StepResult) -> None:
        if self.on_step is not None:
            self.on_step(result)
        for request in result.handoffs:
            if self.on_handoff is not None:
                self.on_handoff(request)
        if result.events or result.tokens:
            self._emit(result.outgoing())

    def _emit(self, events: list[EventItem]) -> None:
        for event in events:
            if isinstance(event, TokenEvent) and event.finish_reason is not None:
                self._open.discard(event.request_id)
        if events:
            self.on_events(events)


def _drop(events: list[EventItem]) -> None:
    """The default `on_events` of a loop nobody reads."""


def _ignore(exc: BaseException) -> None:
    """The default `on_death`: the owner reads `healthy`."""


def exit_for_restart(exc: BaseException) -> None:
    """`EngineLoop.on_death` of a worker process: exit once the failed
    streams' error events have had `EXIT_GRACE_S` to leave, so Ray restarts
    the worker (`cluster.launch.launcher.MAX_RESTARTS`) and the router routes around
    it meanwhile, as for a worker that crashed."""
    logger.error(
        "the engine loop died (%r); this worker exits in %.1f s so that Ray restarts it",
        exc,
        EXIT_GRACE_S,
    )
    asyncio.get_running_loop().call_later(EXIT_GRACE_S, os._exit, EXIT_CODE_ENGINE_DIED)


def _error_event(request: Request, message: str) -> TokenEvent:
    return TokenEvent.ended(request.request_id, "error", message, request.num_prompt_tokens)
