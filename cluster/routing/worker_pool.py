"""The workers of one role as the router sees them: which one gets a request,
and what a dispatch and a failed dispatch leave in the metrics.

A pool picks by its routing policy (`cluster.routing.policies`) among the healthy
workers the request has not tried yet (all of them when none is left), and
counts every dispatch per worker and phase, with a cache hit when the worker
is known to hold a leading block of the prompt (`kv`) or the embeddings of
one of its images (`encoder`). A call awaited through `answer` ends with the
pool's `give_up` error when the router gives up on a silent worker, instead
of waiting for a worker that may never answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from ray.exceptions import RayActorError, RayTaskError

from cluster.metrics import ServingMetrics
from cluster.routing.policies import make_policy
from cluster.routing.worker_poller import WorkerEndpoint

logger = logging.getLogger(__name__)

T = TypeVar("T")


class WorkerPool:
    def __init__(
        self, endpoints: Sequence[WorkerEndpoint], policy: str, metrics: ServingMetrics
    ) -> None:
        self.endpoints = list(endpoints)
        self._policy = make_policy(policy)
        self._metrics = metrics
        # Per worker: failed by `give_up`, then replaced by the next `answer`.
        self._silences: dict[str, asyncio.Future[None]] = {}

    def pick(
        self, hashes: Sequence[bytes], tried: Sequence[WorkerEndpoint], images: Sequence[bytes] = ()
    ) -> WorkerEndpoint:
        """The policy's choice, skipping workers in `tried` while others remain."""
        candidates = [e for e in self.endpoints if e not in tried and e.state.healthy]
        candidates = candidates or self.endpoints
        state = self._policy.choose([e.state for e in candidates], hashes, images)
        return next(e for e in candidates if e.state is state)

    def dispatch(
        self,
        phase: str,
        hashes: Sequence[bytes],
        touched: list[WorkerEndpoint],
        images: Sequence[bytes] = (),
        to: WorkerEndpoint | None = None,
    ) -> WorkerEndpoint:
        """Send the request's `phase` to `to`, or to the pool's pick: the worker
        joins `touched` (which an abort reaches) and the dispatch is counted."""
        endpoint = to or self.pick(hashes, touched, images)
        touched.append(endpoint)
        self._metrics.routed.labels(endpoint.name, phase).inc()
        hits = self._metrics.routed_cache_hits
        if endpoint.state.prefix_match(hashes):
            hits.labels(endpoint.name, phase, "kv").inc()
        if endpoint.state.image_match(images):
            hits.labels(endpoint.name, phase, "encoder").inc()
        return endpoint

    async def answer(self, endpoint: WorkerEndpoint, call: Awaitable[T]) -> T:
        """What `call` (a call to `endpoint`) returns, or raises; the
        error of `give_up(endpoint)` if that comes first."""
        silence = self._silences.get(endpoint.name)
        if silence is None:
            silence = asyncio.get_running_loop().create_future()
            self._silences[endpoint.name] = silence
        answered = asyncio.ensure_future(call)
        try:
            await asyncio.wait((answered, silence), return_when=asyncio.FIRST_COMPLETED)
            if answered.done():
                return answered.result()
            error = silence.exception()
            assert error is not None
            raise error
        finally:
            if not answered.done():
                answered.cancel()

    def give_up(self, endpoint: WorkerEndpoint, error: BaseException) -> None:
        """Calls to `endpoint` awaited through `answer` raise `error` now."""
        silence = self._silences.pop(endpoint.name, None)
        if silence is not None and not silence.done():
            silence.set_exception(error)
            silence.exception()  # retrieved: nobody may be waiting


def dispatch_failed(
    endpoint: WorkerEndpoint, exc: BaseException, phase: str, metrics: ServingMetrics
) -> str:
    """Record a failed dispatch; returns the reason for the client.

    A dead actor is routed around until it answers a poll again; a request
    the worker refused (`RequestFailedError`) leaves the worker healthy.
    """
    if isinstance(exc, RayActorError):
        logger.warning("worker %s is unreachable (%s); routing around it", endpoint.name, exc)
        endpoint.state.healthy = False
    metrics.dispatch_failures.labels(phase).inc()
    cause = exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc
    return f"{endpoint.name}: {cause}"


def abort_everywhere(request_id: str, touched: Sequence[WorkerEndpoint]) -> None:
    """Abort the request on every worker it reached, each once."""
    for endpoint in {id(e): e for e in touched}.values():
        # Fire and forget: the caller is gone, and a dead worker's abort
        # failing must not mask the original error.
        endpoint.actor.abort.remote(request_id)
