"""Faults on a local Ray cluster: killed, paused and disconnected parties.

Two 2P2D clusters (Python and NIXL transceivers) started by the launcher
(actors restart after a crash) share one Ray session. Each test drives a
router over them, injects one fault (`ray.kill`, SIGSTOP/SIGCONT of an
actor's process, a client that stops reading) and checks the outcome: the
affected request is re-run (resumed after the first token, when only that
one reached the caller before its cache was lost), or ends with a clear
error; every other request returns the fault-free tokens; every
surviving (or restarted) worker passes its integrity check with all blocks
free again.

Pausing both generation workers before a request lets a test act at one
exact point: the prefill ran, its cache is pinned on the holder, and the
generation call waits in a paused process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from cluster.config.plan import resolve_plan
from cluster.config.schema import config_from_dict
from cluster.launch.launcher import RunningCluster, init_local_ray, launch
from cluster.metrics import ServingMetrics
from cluster.routing import worker_poller
from cluster.routing.policies import WorkerState
from cluster.routing.router import Router, RoutingSettings
from cluster.routing.worker_poller import WorkerEndpoint
from engine.messages import TokenEvent, WorkerIntegrity
from engine.sampling import SamplingParams
from engine.threads import compute_executor
from models.embedded.writer import write_checkpoint

KINDS = ("python", "nixl")
TIMEOUT_S = 2.0  # cache_transceiver.timeout_s: a paused holder trips it quickly
PROMPTS = [[10 + (7 * i + j) % 400 for j in range(13 + 5 * i)] for i in range(4)]
LONG_TOKENS = 120  # long enough to kill a worker while it streams
SPECULATION = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningCluster]]:
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("faults") / "llama", "llama", "tiny")
    init_local_ray(8, log_to_driver=False)
    plans = {kind: resolve_plan(config_from_dict(_config(checkpoint, kind))) for kind in KINDS}

    async def start() -> list[RunningCluster]:
        return list(await asyncio.gather(*(launch(plans[k], 120) for k in KINDS)))

    running = dict(zip(KINDS, asyncio.run(start()), strict=True))
    try:
        yield running

        async def restarted() -> None:  # the last killed worker came back clean
            actors = [i.actor for c in running.values() for i in c.instances]
            await asyncio.gather(*(wait_idle(actor, 30.0) for actor in actors))

        asyncio.run(restarted())
    finally:

        async def stop() -> None:
            await asyncio.gather(*(c.shutdown() for c in running.values()))

        asyncio.run(stop())
        ray.shutdown()


def _config(checkpoint: Path, kind: str) -> dict[str, Any]:
    return {
        "model": str(checkpoint),
        "port": 0,
        "dtype": "float32",
        "cache_transceiver": {"backend": kind, "timeout_s": TIMEOUT_S, "lease_s": 60},
        "kv_cache": {"manager": "v1", "block_size": 8, "max_tokens": 1024},
        "max_num_tokens": 64,
        "max_batch_size": 8,
        "context_servers": {"num_instances": 2},
        "generation_servers": {"num_instances": 2},
        # The Python-transceiver cluster also verifies n-gram drafts (the
        # prompts repeat), so every fault below meets requests mid-speculation.
        **({"speculative_config": SPECULATION} if kind == "python" else {}),
    }


class Harness:
    """A router over one launched cluster, plus the fault injectors."""

    def __init__(self, cluster: RunningCluster, aggregated: bool = False) -> None:
        self.cluster = cluster
        self.metrics = ServingMetrics()
        self.paused: set[int] = set()  # resumed at teardown if a test failed midway

        def endpoints(role: str) -> list[WorkerEndpoint]:
            return [
                WorkerEndpoint(i.plan.name, i.actor, WorkerState(i.plan.name))
                for i in cluster.actors(role)
            ]

        settings = RoutingSettings("round_robin", 0, 8, 8, hash_namespace="")
        # Aggregated: no context pool, so every request runs whole on a generation worker.
        context = [] if aggregated else endpoints("context")
        self.router = Router(context, endpoints("generation"), settings, self.metrics)

    def endpoint(self, name: str) -> WorkerEndpoint:
        return next(e for e in self.router.workers if e.name == name)

    def routed(self, name: str, phase: str) -> float:
        value = self.metrics.registry.get_sample_value(
            "disagg_routed_requests_total", {"worker": name, "phase": phase}
        )
        return value or 0.0

    async def wait_routed(self, role: str, phase: str, before: dict[str, float]) -> str:
        """The worker of `role` whose `phase` count grew past `before`."""
        for _ in range(400):
            for e in getattr(self.router, role):
                if self.routed(e.name, phase) > before.get(e.name, 0.0):
                    return str(e.name)
            await asyncio.sleep(0.025)
        raise AssertionError(f"no {role} worker got a {phase} request")

    def counts(self, role: str, phase: str) -> dict[str, float]:
        return {e.name: self.routed(e.name, phase) for e in getattr(self.router, role)}

    async def run(self, rid: str, prompt: list[int], max_tokens: int) -> list[TokenEvent]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [event async for event in self.router.generate(rid, prompt, params)]

    async def all_idle(self, timeout_s: float = 30.0, killed: str = "") -> None:
        """Every worker (restarted ones included) answers integrity() idle;
        but for `killed`, whose restart the next test's harness (or the
        module's teardown) awaits while the tests go on."""
        await asyncio.gather(
            *(wait_idle(e.actor, timeout_s) for e in self.router.workers if e.name != killed)
        )


async def wait_idle(actor: Any, timeout_s: float) -> WorkerIntegrity:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = await asyncio.wait_for(
                actor.integrity.remote(), max(0.1, deadline - time.monotonic())
            )
        except ray.exceptions.RayActorError as exc:  # restarting: ask again
            last = exc
        except TimeoutError:
            break
        else:
            assert last.ok, last.problems
            if last.idle:
                return last  # type: ignore[no-any-return]
        await asyncio.sleep(0.1)
    raise AssertionError(f"worker {actor} not idle within {timeout_s}s: {last}")


async def pid_of(actor: Any) -> int:
    return int(await actor.__ray_call__.remote(lambda _self: os.getpid()))


def tokens(events: list[TokenEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


@pytest.fixture(params=KINDS)
async def harness(
    request: pytest.FixtureRequest, clusters: dict[str, RunningCluster]
) -> AsyncIterator[Harness]:
    h = Harness(clusters[request.param])
    await h.all_idle()  # a previous test's restarts are complete
    h.router.start()
    try:
        yield h
    finally:
        for pid in h.paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        await h.router.stop()


async def _expected(h: Harness, max_tokens: int) -> list[list[int]]:
    runs = [h.run(f"ref-{i}-{time.monotonic_ns()}", p, max_tokens) for i, p in enumerate(PROMPTS)]
    results = await asyncio.gather(*runs)
    assert all(r[-1].finish_reason == "length" for r in results)
    return [tokens(r) for r in results]


async def _paused_at_pull(
    h: Harness, rid: str, prompt: list[int]
) -> tuple[asyncio.Task[list[TokenEvent]], str, str, dict[str, int]]:
    """Pause both generation workers and send a request: returns its task,
    the context worker holding its cache, the generation worker waiting to
    pull it, and every worker's pid (the caller resumes the generation ones)."""
    pids = {e.name: await pid_of(e.actor) for e in h.router.workers}
    before_ctx = h.counts("context", "context")
    before_gen = h.counts("generation", "generation")
    for e in h.router.generation:
        h.paused.add(pids[e.name])
        os.kill(pids[e.name], signal.SIGSTOP)
    task = asyncio.ensure_future(h.run(rid, prompt, 8))
    holder = await h.wait_routed("context", "context", before_ctx)
    puller = await h.wait_routed("generation", "generation", before_gen)
    return task, holder, puller, pids


def _resume_generation(h: Harness, pids: dict[str, int], skip: str = "") -> None:
    for e in h.router.generation:
        if e.name != skip:
            os.kill(pids[e.name], signal.SIGCONT)
        h.paused.discard(pids[e.name])


async def _until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def test_the_python_cluster_verifies_drafts_in_the_faults_below(harness: Harness) -> None:
    """The faults meet requests mid-speculation on the Python-transceiver
    cluster: its generation workers verify drafts, and accept some."""
    await _expected(harness, 24)
    loads = [await i.actor.load.remote() for i in harness.cluster.actors("generation")]
    drafted = sum(load.spec_drafted for load in loads)
    accepted = sum(load.spec_accepted for load in loads)
    if any(i.plan.speculative is not None for i in harness.cluster.instances):
        assert drafted > 0 and accepted > 0, (drafted, accepted)
    else:
        assert drafted == 0


async def test_a_paused_worker_fails_its_polls_and_the_others_keep_serving(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that never answers (a hung node) is marked unhealthy by the
    poll timeout, and the polls of the other workers go on meanwhile."""
    h = harness
    monkeypatch.setattr(worker_poller, "POLL_TIMEOUT_S", 1.0)
    hung = h.router.context[0]
    pid = await pid_of(hung.actor)
    await asyncio.sleep(1)  # polls that started under the old timeout are answered
    h.paused.add(pid)
    os.kill(pid, signal.SIGSTOP)
    await _until(lambda: not hung.state.healthy, 20, "the paused worker still counts as healthy")
    assert all(e.state.healthy for e in h.router.workers if e is not hung)
    events = await h.run("poll-timeout", PROMPTS[0], 4)
    assert len(tokens(events)) == 4 and events[-1].finish_reason == "length"
    os.kill(pid, signal.SIGCONT)
    h.paused.discard(pid)
    await _until(lambda: hung.state.healthy, 20, "the resumed worker is not healthy again")


async def test_the_first_token_reaches_the_caller_before_the_cache_moves(
    harness: Harness,
) -> None:
    """The context worker's first token is sent on at once: it arrives while
    every generation worker is paused, and the stream completes with the
    fault-free tokens once they resume."""
    h = harness
    expected = tokens(await h.run("ref-early", PROMPTS[0], 8))
    pids = {e.name: await pid_of(e.actor) for e in h.router.generation}
    for pid in pids.values():
        h.paused.add(pid)
        os.kill(pid, signal.SIGSTOP)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    stream = h.router.generate("early", PROMPTS[0], params)
    try:
        first = await asyncio.wait_for(anext(stream), 4 * TIMEOUT_S)
    finally:
        _resume_generation(h, pids)
    assert first.token_ids == expected[:1] and not first.finished
    rest = await asyncio.wait_for(_drain(stream), 4 * TIMEOUT_S)
    assert tokens([first, *rest]) == expected and rest[-1].finish_reason == "length"
    await h.all_idle()


async def test_a_held_first_token_waits_for_the_cache_and_the_stream_matches(
    harness: Harness,
) -> None:
    """`router.first_token_at: admission`: while the generation workers are
    paused no token reaches the caller, though the prefill is done; once
    they resume, the first token and the rest are the fault-free ones."""
    h = harness
    hold(h)
    expected = tokens(await h.run("ref-held", PROMPTS[0], 8))
    pids = {e.name: await pid_of(e.actor) for e in h.router.generation}
    before = h.counts("generation", "generation")
    for pid in pids.values():
        h.paused.add(pid)
        os.kill(pid, signal.SIGSTOP)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    stream = h.router.generate("held", PROMPTS[0], params)
    first = asyncio.ensure_future(anext(stream))
    try:
        # Dispatched to a generation worker: the prefill is done.
        await h.wait_routed("generation", "generation", before)
        await asyncio.sleep(TIMEOUT_S / 4)
        assert not first.done(), "a held first token reached the caller before its cache moved"
    finally:
        _resume_generation(h, pids)
    head = await asyncio.wait_for(first, 4 * TIMEOUT_S)
    rest = await asyncio.wait_for(_drain(stream), 4 * TIMEOUT_S)
    assert tokens([head, *rest]) == expected and rest[-1].finish_reason == "length"
    await h.all_idle()


def hold(h: Harness, held: bool = True) -> None:
    """Send disaggregated requests' first tokens at `cache_ready` (or at once)."""
    h.router.settings = dataclasses.replace(h.router.settings, hold_first_token=held)


@pytest.mark.parametrize("held", [False, True], ids=["at-prefill", "held"])
async def test_killed_context_holder_is_retried_on_the_other_context_worker(
    harness: Harness, held: bool
) -> None:
    """The holder dies after its prefill, before the pull: the puller gets
    PeerGone (or times out), frees its blocks, and the router runs the
    request again elsewhere (from the first token it sent, or from the start
    while that token is held); the caller sees only the fault-free tokens."""
    h = harness
    hold(h, held)
    [expected] = [tokens(await h.run("ref-holder", PROMPTS[1], 8))]
    task, holder, _puller, pids = await _paused_at_pull(h, "holder-dies", PROMPTS[1])
    os.kill(pids[holder], signal.SIGKILL)
    _resume_generation(h, pids)
    events = await asyncio.wait_for(task, 4 * TIMEOUT_S)
    assert events[-1].finish_reason == "length", events[-1]
    assert tokens(events) == expected
    assert h.metrics.registry.get_sample_value(
        "disagg_dispatch_failures_total", {"phase": "generation"}
    )
    await h.all_idle(killed=holder)


@pytest.mark.parametrize("held", [False, True], ids=["at-prefill", "held"])
async def test_killed_puller_releases_the_holder_and_the_request_reruns(
    harness: Harness, held: bool
) -> None:
    h = harness
    hold(h, held)
    expected = tokens(await h.run("ref-puller", PROMPTS[2], 8))
    task, holder, puller, pids = await _paused_at_pull(h, "puller-dies", PROMPTS[2])
    os.kill(pids[puller], signal.SIGKILL)
    _resume_generation(h, pids, skip=puller)
    events = await asyncio.wait_for(task, 4 * TIMEOUT_S)
    assert tokens(events) == expected and events[-1].finish_reason == "length"
    # The holder of the first attempt was released by the router's abort,
    # long before its 60 s lease.
    await wait_idle(h.endpoint(holder).actor, 5.0)
    await h.all_idle(killed=puller)


async def test_stalled_holder_times_out_then_the_request_reruns_and_both_sides_free(
    harness: Harness,
) -> None:
    """A paused holder: the pull stalls past cache_transceiver.timeout_s
    (Python; NIXL READs are one-sided and may complete from a paused
    process), the puller frees, the request re-runs; once resumed, the
    holder frees at once, not at lease expiry."""
    h = harness
    expected = tokens(await h.run("ref-stall", PROMPTS[3], 8))
    task, holder, _puller, pids = await _paused_at_pull(h, "holder-stalls", PROMPTS[3])
    holder_pid = pids[holder]
    os.kill(holder_pid, signal.SIGSTOP)
    try:
        _resume_generation(h, pids)
        events = await asyncio.wait_for(task, 4 * TIMEOUT_S)
    finally:
        os.kill(holder_pid, signal.SIGCONT)
    assert tokens(events) == expected and events[-1].finish_reason == "length"
    failures = h.metrics.registry.get_sample_value(
        "disagg_dispatch_failures_total", {"phase": "generation"}
    )
    if h.cluster.plan.transceiver == "python":
        assert failures, "the stalled pull should have failed with TransferTimeout"
    await wait_idle(h.endpoint(holder).actor, 5.0)
    await h.all_idle()


async def test_killed_generation_worker_fails_its_streams_others_complete_and_it_returns(
    harness: Harness,
) -> None:
    h = harness
    expected = await _expected(h, LONG_TOKENS)
    victim = h.router.generation[0]
    streams = [h.router.generate(f"long-{i}", p, _long()) for i, p in enumerate(PROMPTS)]
    # Two events each: the second comes from a generation worker, so every
    # request is decoding there, past its pull.
    heads = await asyncio.gather(*(_take(s, 2) for s in streams))
    ray.kill(victim.actor, no_restart=False)
    results = await asyncio.gather(*(_drain(s) for s in streams))
    _some_failed_with(victim.name, heads, results, expected)
    assert not victim.state.healthy  # routed around until it answers again
    await h.all_idle()  # Ray restarted it; the others freed everything
    for _ in range(100):
        if victim.state.healthy:
            break
        await asyncio.sleep(0.1)
    assert victim.state.healthy, "the restarted worker should be polled healthy again"
    before = h.routed(victim.name, "generation")
    again = await asyncio.gather(*(h.run(f"again-{i}", p, 8) for i, p in enumerate(PROMPTS)))
    assert all(r[-1].finish_reason == "length" for r in again)
    assert h.routed(victim.name, "generation") > before


async def _silence_after(h: Harness, monkeypatch: pytest.MonkeyPatch, stall_s: float) -> None:
    """Polls time out after 0.5 s, and the router moves a silent worker's
    requests after `stall_s`."""
    monkeypatch.setattr(worker_poller, "POLL_TIMEOUT_S", 0.5)
    h.router.settings = dataclasses.replace(h.router.settings, stall_timeout_s=stall_s)
    await asyncio.sleep(1)  # polls that started under the old timeout are answered


async def test_a_silent_generation_worker_s_streams_end_and_it_frees_them_when_back(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A generation worker stopped mid-stream is alive, so no stream breaks:
    after the stall timeout its streams end with an error naming it, the
    other worker's complete, and once resumed it frees everything."""
    h = harness
    expected = await _expected(h, LONG_TOKENS)
    await _silence_after(h, monkeypatch, 1.5)
    victim = h.router.generation[0]
    pid = await pid_of(victim.actor)
    streams = [h.router.generate(f"silent-{i}", p, _long()) for i, p in enumerate(PROMPTS)]
    heads = await asyncio.gather(*(_take(s, 2) for s in streams))  # all decoding
    h.paused.add(pid)
    os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*(_drain(s) for s in streams)), 20)
    _some_failed_with(f"{victim.name} answered nothing", heads, results, expected)
    # Not before the stall timeout, which counts from the last poll answered
    # (one interval at most before the stop).
    assert time.monotonic() - started >= 1.5 - 2 * worker_poller.POLL_INTERVAL_S
    os.kill(pid, signal.SIGCONT)
    h.paused.discard(pid)
    await h.all_idle()  # the aborts reached it once it was back


@pytest.mark.parametrize("harness", ["python"], indirect=True)
async def test_a_generation_worker_whose_step_hangs_has_its_streams_ended(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A generation worker's compute thread hangs mid-stream while its event
    loop still answers polls: after the stall timeout its streams end with an
    error naming the hung step, the other worker's complete, and once the
    step returns it frees them. The transceiver plays no part (one kind)."""

    def hang_compute(worker: Any) -> None:  # as a collective that never returns
        worker.test_compute_gate = threading.Event()
        compute_executor().submit(worker.test_compute_gate.wait)  # the next step waits

    def release_compute(worker: Any) -> None:
        worker.test_compute_gate.set()

    h = harness
    expected = await _expected(h, LONG_TOKENS)
    await _silence_after(h, monkeypatch, 1.5)
    victim = h.router.generation[0]
    streams = [h.router.generate(f"hung-{i}", p, _long()) for i, p in enumerate(PROMPTS)]
    heads = await asyncio.gather(*(_take(s, 2) for s in streams))  # all decoding
    await victim.actor.__ray_call__.remote(hang_compute)
    try:
        started = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*(_drain(s) for s in streams)), 20)
        assert time.monotonic() - started >= 1.5 - 2 * worker_poller.POLL_INTERVAL_S
        assert not victim.state.healthy  # answering, but no new request goes to it
        _some_failed_with(f"{victim.name} has computed one engine step", heads, results, expected)
    finally:
        await victim.actor.__ray_call__.remote(release_compute)
    await h.all_idle()  # the step returned and the aborts freed its requests
    await _until(lambda: victim.state.healthy, 5, "the victim is healthy again")


def _step_breaker() -> Callable[[Any], int]:
    """For a worker's `__ray_call__`: its next step raises; returns its pid.
    (A nested function, so Ray ships it by value, not as this module's.)"""

    def break_next_step(worker: Any) -> int:
        def schedule() -> Any:
            raise RuntimeError("injected step failure")

        worker.engine.core.schedule = schedule
        return os.getpid()

    return break_next_step


async def test_a_generation_worker_whose_engine_loop_dies_exits_and_ray_restarts_it(
    harness: Harness,
) -> None:
    """A step that raises kills a generation worker's engine loop (a bug, a
    device error): its streams end with the error, and instead of staying up
    with a loop that never steps again (every later request would wait
    forever) the worker exits, Ray restarts it, and it serves again."""

    h = harness
    expected = await _expected(h, LONG_TOKENS)
    victim = h.router.generation[0]
    streams = [h.router.generate(f"died-{i}", p, _long()) for i, p in enumerate(PROMPTS)]
    heads = await asyncio.gather(*(_take(s, 2) for s in streams))  # all decoding
    pid = await victim.actor.__ray_call__.remote(_step_breaker())
    results = await asyncio.wait_for(asyncio.gather(*(_drain(s) for s in streams)), 20)
    _some_failed_with("injected step failure", heads, results, expected)
    await h.all_idle()  # a new process answers, with nothing of the old one left
    assert await pid_of(victim.actor) != pid
    await _until(lambda: victim.state.healthy, 10, "the restarted worker is healthy again")
    before = h.routed(victim.name, "generation")
    again = await asyncio.gather(*(h.run(f"after-{i}", p, 8) for i, p in enumerate(PROMPTS)))
    assert all(r[-1].finish_reason == "length" for r in again)
    assert h.routed(victim.name, "generation") > before


async def test_whole_requests_failed_by_a_dying_engine_loop_rerun_on_the_other_worker(
    clusters: dict[str, RunningCluster],
) -> None:
    """Requests run whole (an aggregated router) that a generation worker's
    engine loop failed before any token left, its loop dying at their first
    step, run again on the other worker: every caller gets the fault-free
    tokens, and the worker exits and comes back. The transceiver plays no
    part (one kind)."""
    h = Harness(clusters["python"], aggregated=True)
    await h.all_idle()  # a previous test's restarts are complete
    h.router.start()
    try:
        runs = [h.run(f"ref-whole-{i}", p, 8) for i, p in enumerate(PROMPTS)]
        expected = [tokens(r) for r in await asyncio.gather(*runs)]
        victim = h.router.generation[0]
        before = h.counts("generation", "whole")
        pid = await victim.actor.__ray_call__.remote(_step_breaker())
        runs = [h.run(f"whole-{i}", p, 8) for i, p in enumerate(PROMPTS)]
        results = await asyncio.wait_for(asyncio.gather(*runs), 30)
        assert [tokens(r) for r in results] == expected
        assert all(r[-1].finish_reason == "length" for r in results)
        after = h.counts("generation", "whole")
        assert after[victim.name] > before[victim.name]  # it got some, and failed them
        assert sum(after.values()) - sum(before.values()) > len(PROMPTS)  # and they reran
        await h.all_idle()  # a new process answers, with nothing of the old one left
        assert await pid_of(victim.actor) != pid
    finally:
        await h.router.stop()


async def test_a_context_worker_whose_engine_loop_dies_exits_and_its_prefills_rerun(
    harness: Harness,
) -> None:
    """The same on a context worker: the prefills its dead loop failed run
    again on the other context worker (no token had left, so the callers get
    the fault-free tokens), and the worker exits, Ray restarts it, and it
    prefills again."""
    h = harness
    expected = await _expected(h, 8)
    victim = h.router.context[0]
    pid = await victim.actor.__ray_call__.remote(_step_breaker())
    before = h.routed(victim.name, "context")
    # Round robin: some of these go to the victim.
    runs = [h.run(f"ctx-died-{i}", p, 8) for i, p in enumerate(PROMPTS)]
    results = await asyncio.wait_for(asyncio.gather(*runs), 30)
    assert h.routed(victim.name, "context") > before
    for events, want in zip(results, expected, strict=True):
        assert tokens(events) == want and events[-1].finish_reason == "length"
    await h.all_idle()
    assert await pid_of(victim.actor) != pid
    await _until(lambda: victim.state.healthy, 10, "the restarted worker is healthy again")
    before = h.routed(victim.name, "context")
    again = await asyncio.gather(*(h.run(f"ctx-after-{i}", p, 8) for i, p in enumerate(PROMPTS)))
    assert [tokens(r) for r in again] == expected
    assert h.routed(victim.name, "context") > before


async def test_a_prefill_on_a_silent_context_worker_runs_on_the_other_one(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A context worker stopped before it answered a prefill: the prefill
    runs again on the other context worker after the stall timeout, the
    caller gets the fault-free tokens, and the stopped worker, once back,
    drops the abandoned prompt (the router aborted it there)."""
    h = harness
    expected = await _expected(h, 8)
    await _silence_after(h, monkeypatch, 1.5)
    victim = h.router.context[0]
    pid = await pid_of(victim.actor)
    h.paused.add(pid)
    os.kill(pid, signal.SIGSTOP)
    before = h.routed(victim.name, "context")
    # Round robin: while the victim still counts as healthy, one of these
    # two goes to it.
    runs = [h.run(f"stalled-prefill-{i}", PROMPTS[i], 8) for i in range(2)]
    results = await asyncio.wait_for(asyncio.gather(*runs), 20)
    assert h.routed(victim.name, "context") > before
    for events, want in zip(results, expected[:2], strict=True):
        assert tokens(events) == want and events[-1].finish_reason == "length"
    os.kill(pid, signal.SIGCONT)
    h.paused.discard(pid)
    await h.all_idle()


async def test_client_disconnect_mid_stream_frees_both_sides(harness: Harness) -> None:
    h = harness
    stream = h.router.generate("goes-away", PROMPTS[0], _long())
    for _ in range(3):
        await anext(stream)
    await stream.aclose()  # what the server does when the client disconnects
    await h.all_idle(10.0)


async def test_the_request_moves_on_while_the_caller_holds_the_first_token(
    harness: Harness,
) -> None:
    """The router sends the request to a generation worker before the caller
    asks for the next event; a caller that leaves then frees both sides."""
    h = harness
    stream = h.router.generate("held", PROMPTS[0], _long())
    first = await anext(stream)
    assert first.token_ids and not first.finished
    deadline = time.monotonic() + 4 * TIMEOUT_S
    while True:
        loads = [await e.actor.load.remote() for e in h.router.generation]
        if any(load.num_running + load.num_transferring for load in loads):
            break
        assert time.monotonic() < deadline, "no generation worker got the request"
        await asyncio.sleep(0.05)
    await stream.aclose()
    await h.all_idle(10.0)


@pytest.mark.parametrize("held", [False, True], ids=["at-prefill", "held"])
async def test_client_disconnect_during_the_pull_frees_both_sides(
    harness: Harness, held: bool
) -> None:
    h = harness
    hold(h, held)
    task, _holder, _puller, pids = await _paused_at_pull(h, "gone-early", PROMPTS[0])
    task.cancel()
    _resume_generation(h, pids)
    with pytest.raises(asyncio.CancelledError):
        await task
    await h.all_idle(10.0)


def _long() -> SamplingParams:
    return SamplingParams(max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True)


async def _take(stream: AsyncIterator[TokenEvent], n: int) -> list[TokenEvent]:
    return [await anext(stream) for _ in range(n)]


async def _drain(stream: AsyncIterator[TokenEvent]) -> list[TokenEvent]:
    return [event async for event in stream]


def _some_failed_with(
    error: str,
    heads: list[list[TokenEvent]],
    results: list[list[TokenEvent]],
    expected: list[list[int]],
) -> None:
    """Some streams, not all, ended with an error naming `error`, their tokens
    so far a prefix of the expected ones; the others completed them whole."""
    failed = 0
    for head, rest, want in zip(heads, results, expected, strict=True):
        got = tokens([*head, *rest])
        if rest[-1].finish_reason == "error":
            failed += 1
            assert error in (rest[-1].error or ""), rest[-1]
            assert got == want[: len(got)]
        else:
            assert rest[-1].finish_reason == "length" and got == want
    assert 0 < failed < len(PROMPTS)


@pytest.mark.parametrize("victim", ["holder", "puller"])
async def test_a_side_killed_mid_transfer_reruns_the_request_and_frees_the_other(
    harness: Harness, victim: str
) -> None:
    """The holder is paused once the pull started, so the transfer hangs
    half-way; then one side is killed. The survivor frees its blocks (the
    puller on PeerGone within its timeout, the holder on the router's abort
    and the puller's release) and the request re-runs on the other pair."""
    h = harness
    expected = tokens(await h.run(f"ref-mid-{victim}", PROMPTS[2], 8))
    task, holder, puller, pids = await _paused_at_pull(h, f"mid-{victim}", PROMPTS[2])
    os.kill(pids[holder], signal.SIGSTOP)
    try:
        _resume_generation(h, pids)
        await asyncio.sleep(TIMEOUT_S / 4)  # the pull is under way and stuck
        os.kill(pids[holder if victim == "holder" else puller], signal.SIGKILL)
    finally:
        os.kill(pids[holder], signal.SIGCONT)
    events = await asyncio.wait_for(task, 4 * TIMEOUT_S)
    assert tokens(events) == expected and events[-1].finish_reason == "length"
    survivor = puller if victim == "holder" else holder
    await wait_idle(h.endpoint(survivor).actor, 5.0)
    await h.all_idle(killed=holder if victim == "holder" else puller)


PIPELINED_PROMPT = [10 + (3 * j) % 400 for j in range(300)]  # five 64-token prefill chunks


@pytest.mark.parametrize("victim", ["holder", "puller"])
async def test_a_side_killed_mid_prompt_of_a_pipelined_pull_reruns_and_frees_the_other(
    harness: Harness, victim: str
) -> None:
    """Chunk-pipelined transfer: the generation worker pulls a long prompt's
    chunks as the context worker offers them, and one side is killed once the
    first chunk was offered. The prefetch gives up (or dies with its worker),
    the request re-runs with a whole pull, and every worker, the restarted one
    included, returns to all blocks free."""
    h = harness
    expected = tokens(await h.run(f"ref-pipelined-{victim}", PIPELINED_PROMPT, 8))
    h.router.settings = dataclasses.replace(h.router.settings, pipeline_above_tokens=64)
    pids = {e.name: await pid_of(e.actor) for e in h.router.workers}
    before = {**h.counts("context", "context"), **h.counts("generation", "prefetch")}
    rid = f"pipelined-{victim}"
    task = asyncio.ensure_future(h.run(rid, PIPELINED_PROMPT, 8))
    holder = await h.wait_routed("context", "context", before)
    puller = await h.wait_routed("generation", "prefetch", before)
    await h.endpoint(holder).actor.blocks_ready.remote(rid, 0)  # a chunk was offered
    os.kill(pids[holder if victim == "holder" else puller], signal.SIGKILL)
    events = await asyncio.wait_for(task, 4 * TIMEOUT_S)
    got = tokens(events)
    if victim == "puller" and events[-1].error is not None:
        # The context worker may have finished and its first token reached
        # the client before the kill: no retry after a first token, so the
        # stream ends with an error after a prefix of the tokens.
        assert got == expected[: len(got)] and got
    else:
        assert got == expected and events[-1].finish_reason == "length"
    await h.all_idle(killed=holder if victim == "holder" else puller)
