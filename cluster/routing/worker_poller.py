"""The router's background view of every worker: load, cache events, health.

Every `POLL_INTERVAL_S` the poller asks each worker for one `WorkerReport`
(its load and the KV / encoder-cache events since the last report, one Ray
call) and applies it to that worker's `WorkerState` (what the routing
policies read) and to the serving metrics. A worker that does not answer
within `POLL_TIMEOUT_S`, or whose call fails, is unhealthy until a later
poll is answered (e.g. after Ray restarted it); one slow worker never holds
up the others' polls beyond that timeout. A worker that answers while one
engine step has computed for `POLL_TIMEOUT_S` (a compute thread that hangs in
a collective or on a wedged device) is unhealthy too, until the step ends.

Both kinds of stall are reported at every poll with how long the worker has
made no progress (`on_stalled`): the router moves a stalled worker's
requests elsewhere after `router.stall_timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.metrics import ServingMetrics
from cluster.routing.policies import WorkerState
from engine.messages import WorkerReport
from runtime.cancellation import cancel_and_wait, stop_if_cancelled

logger = logging.getLogger(__name__)

# Each poll is a Ray call per worker, on the serving process and on the
# worker. `least_loaded` stays exact between polls through the router's own
# `tokens_in_flight` bookkeeping.
POLL_INTERVAL_S = 0.25
# A worker that does not answer a poll within this is unhealthy until it does:
# a hung node must not stall the polls of every other worker.
POLL_TIMEOUT_S = 10.0


@dataclass
class WorkerEndpoint:
    """A worker actor plus the router's view of it."""

    name: str
    actor: Any  # a Ray ActorHandle of a context or generation worker
    state: WorkerState


class UnresponsiveWorkerError(ConnectionError):
    """A worker made no progress for longer than the router waits: it
    answered no poll (a stopped process, a blocked event loop, a node cut
    off), or its engine step never ended (a hung compute thread)."""


# How a stalled worker is described to `on_stalled`, by the kind of stall.
SILENT = "answered nothing"
STEP_HUNG = "has computed one engine step"


class WorkerPoller:
    def __init__(
        self,
        workers: Callable[[], Sequence[WorkerEndpoint]],
        metrics: ServingMetrics,
        on_stalled: Callable[[WorkerEndpoint, float, str], None] | None = None,
    ) -> None:
        self._workers = workers
        self.metrics = metrics
        # Called after each unanswered poll with the seconds since the
        # worker's last answer (or since polling began) and `SILENT`, and
        # after each answer during a step with the step's seconds so far and
        # `STEP_HUNG`.
        self._on_stalled = on_stalled
        self._answered: dict[str, float] = {}  # worker name -> monotonic time
        self._task: asyncio.Task[None] | None = None
        # Set once the server is stopping: workers that stop answering then
        # are going down with it (a signal to the process group reaches
        # them too), which is no news to warn about.
        self._stopping = False

    def start(self) -> None:
        """Start polling; call from the serving event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._poll_forever())

    def expect_stop(self) -> None:
        """The server is stopping: unanswered polls from now on are logged at
        debug level, not as warnings."""
        self._stopping = True

    async def stop(self) -> None:
        self._stopping = True
        try:
            await cancel_and_wait(self._task)
        finally:
            self._task = None

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(e) for e in self._workers()))
            stop_if_cancelled()
            await asyncio.sleep(POLL_INTERVAL_S)

    async def _poll(self, endpoint: WorkerEndpoint) -> None:
        self._answered.setdefault(endpoint.name, time.monotonic())
        try:
            async with asyncio.timeout(POLL_TIMEOUT_S):
                report = await endpoint.actor.report.remote()
        except Exception as exc:
            if endpoint.state.healthy:
                reason = (
                    f"no answer within {POLL_TIMEOUT_S:g} s"
                    if isinstance(exc, TimeoutError)
                    else exc
                )
                log = logger.debug if self._stopping else logger.warning
                log("worker %s stopped answering: %s", endpoint.name, reason)
            endpoint.state.healthy = False
            silent_s = time.monotonic() - self._answered[endpoint.name]
            if self._on_stalled is not None:
                self._on_stalled(endpoint, silent_s, SILENT)
            return
        self._answered[endpoint.name] = time.monotonic()
        step_s = report.load.step_in_flight_s
        if step_s >= POLL_TIMEOUT_S and endpoint.state.healthy:
            logger.warning(
                "worker %s answers, but one engine step has run for %.0f s", endpoint.name, step_s
            )
        self._apply(endpoint, report)
        if step_s and self._on_stalled is not None:
            self._on_stalled(endpoint, step_s, STEP_HUNG)

    def _apply(self, endpoint: WorkerEndpoint, report: WorkerReport) -> None:
        load, batch, state = report.load, report.kv_events, endpoint.state
        state.healthy = load.step_in_flight_s < POLL_TIMEOUT_S
        state.num_queued = load.num_waiting
        state.num_free_blocks = load.num_free_blocks
        state.num_total_blocks = load.num_total_blocks
        metrics, name = self.metrics, endpoint.name
        held = load.num_waiting + load.num_running + load.num_transferring
        metrics.worker_requests.labels(name).set(held)
        metrics.engine_steps.labels(name).set(load.num_steps)
        metrics.engine_busy.labels(name).set(load.step_busy_s)
        if load.encoder_cache_hits or load.encoder_cache_misses:
            metrics.encoder_cache.labels(name, "hit").set(load.encoder_cache_hits)
            metrics.encoder_cache.labels(name, "miss").set(load.encoder_cache_misses)
        if load.num_total_blocks:
            used = 1 - load.num_free_blocks / load.num_total_blocks
            metrics.cache_usage.labels(name).set(used)
        metrics.record_rank_caches(name, load.ranks)
        if load.node_ip:
            metrics.place_worker(name, load.role, load.node_ip)
        stored = [e.block_hash for e in batch.events if e.kind == "stored"]
        removed = [e.block_hash for e in batch.events if e.kind == "removed"]
        state.apply_kv_event(stored, removed)
        metrics.cached_blocks.labels(name).set(len(state.cached_blocks))
        if batch.snapshot_events:
            state.apply_snapshot_events(batch.snapshot_events)
        state.end_poll()
        if load.num_snapshot_slots:
            metrics.record_snapshots(name, load)
        if load.spec_drafted_at:
            metrics.record_speculation(name, load)
        if batch.encoder_events or state.encoded_images:
            state.apply_encoder_events(batch.encoder_events)
            metrics.encoded_images.labels(name).set(len(state.encoded_images))
