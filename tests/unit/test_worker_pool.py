"""A pool of one role's workers: which one a request goes to, and what a dispatch
and a failed dispatch leave in the metrics (pure Python)."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import RayActorError

from cluster.metrics import ServingMetrics
from cluster.routing.policies import WorkerState
from cluster.routing.worker_poller import UnresponsiveWorkerError, WorkerEndpoint
from cluster.routing.worker_pool import WorkerPool, dispatch_failed
from engine.errors import RequestFailedError

HASHES = [b"block-0", b"block-1"]


def _endpoints(n: int) -> list[WorkerEndpoint]:
    return [WorkerEndpoint(f"w{i}", None, WorkerState(f"w{i}")) for i in range(n)]


def _routed(metrics: ServingMetrics, name: str, phase: str, cache: str | None = None) -> float:
    if cache is None:
        sample = metrics.registry.get_sample_value(
            "disagg_routed_requests_total", {"worker": name, "phase": phase}
        )
    else:
        sample = metrics.registry.get_sample_value(
            "disagg_routed_cache_hits_total", {"worker": name, "phase": phase, "cache": cache}
        )
    return sample or 0.0


def test_a_pick_skips_tried_and_unhealthy_workers_while_others_remain() -> None:
    endpoints = _endpoints(3)
    pool = WorkerPool(endpoints, "least_loaded", ServingMetrics())
    endpoints[0].state.tokens_in_flight = 0
    endpoints[1].state.tokens_in_flight = 10
    endpoints[2].state.tokens_in_flight = 20
    assert pool.pick([], tried=[]) is endpoints[0]
    assert pool.pick([], tried=[endpoints[0]]) is endpoints[1]
    endpoints[1].state.healthy = False
    assert pool.pick([], tried=[endpoints[0]]) is endpoints[2]
    # Every worker tried: the policy chooses among all of them again.
    assert pool.pick([], tried=endpoints) is endpoints[0]


def test_a_dispatch_joins_the_touched_workers_and_counts_routing_and_cache_hits() -> None:
    metrics = ServingMetrics()
    endpoints = _endpoints(2)
    pool = WorkerPool(endpoints, "prefix_aware", metrics)
    endpoints[1].state.apply_kv_event(stored=HASHES[:1], removed=[])
    touched: list[WorkerEndpoint] = []
    chosen = pool.dispatch("context", HASHES, touched)
    assert chosen is endpoints[1] and touched == [endpoints[1]]
    assert _routed(metrics, "w1", "context") == 1
    assert _routed(metrics, "w1", "context", "kv") == 1
    # A dispatch to a given worker (one that prefetches) counts the same way.
    pool.dispatch("generation", HASHES, touched, to=endpoints[0])
    assert touched == [endpoints[1], endpoints[0]]
    assert _routed(metrics, "w0", "generation") == 1
    assert _routed(metrics, "w0", "generation", "kv") == 0


def test_a_dead_worker_is_routed_around_and_a_refusal_is_not() -> None:
    metrics = ServingMetrics()
    [endpoint] = _endpoints(1)
    refused = dispatch_failed(endpoint, RequestFailedError("r", "in flight"), "generation", metrics)
    assert endpoint.state.healthy and refused.startswith("w0: ")
    dispatch_failed(endpoint, RayActorError(), "generation", metrics)
    assert not endpoint.state.healthy
    failures = metrics.registry.get_sample_value(
        "disagg_dispatch_failures_total", {"phase": "generation"}
    )
    assert failures == 2


async def test_an_answer_awaited_from_a_worker_given_up_on_raises_the_give_up_error() -> None:
    endpoints = _endpoints(2)
    pool = WorkerPool(endpoints, "round_robin", ServingMetrics())
    loop = asyncio.get_running_loop()
    never: asyncio.Future[str] = loop.create_future()
    waiting = asyncio.ensure_future(pool.answer(endpoints[0], never))
    other: asyncio.Future[str] = loop.create_future()
    elsewhere = asyncio.ensure_future(pool.answer(endpoints[1], other))
    await asyncio.sleep(0.01)
    pool.give_up(endpoints[0], UnresponsiveWorkerError("w0 answered nothing for 30 s"))
    with pytest.raises(UnresponsiveWorkerError, match="w0 answered nothing"):
        await asyncio.wait_for(waiting, 5)
    assert never.cancelled()  # the call is no longer awaited
    other.set_result("prefilled")
    assert await elsewhere == "prefilled"  # another worker's call is untouched
    # Later calls to the worker wait for their own answer again.
    assert await pool.answer(endpoints[0], asyncio.sleep(0, "back")) == "back"


async def test_an_answer_raises_what_the_call_raised() -> None:
    endpoints = _endpoints(1)
    pool = WorkerPool(endpoints, "round_robin", ServingMetrics())

    async def fails() -> str:
        raise RequestFailedError("r", "prompt too long")

    with pytest.raises(RequestFailedError, match="prompt too long"):
        await pool.answer(endpoints[0], fails())
