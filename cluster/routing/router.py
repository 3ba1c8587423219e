"""The router: sends each request through a context and a generation worker.

    prompt ──► policy picks a context worker ──► ContextResult (first token + handle)
           └─► policy picks a generation worker ──► token stream ──► caller

A generation worker's tokens for all its requests arrive on one stream per
worker, one message per engine step (`cluster.routing.worker_channel`), and are
split per request here. Prefills go to a context worker on a socket of its
own (`cluster.routing.context_calls`); both sockets are opened and watched through
Ray calls.

Conditional disaggregation: when the part of the prompt no generation worker
already caches is at most `max_local_prefill_length` tokens, the context hop
is skipped and one generation worker runs the whole request.

Chunk-pipelined transfer: for a prompt longer than one context prefill
chunk the router picks the generation worker first and sends it a
`PrefetchRequest` as it dispatches the prompt, so the finished chunks' blocks
move while later chunks compute; the `GenerationRequest` then joins that pull.

Failure rules: a dispatch that fails before any token reached the caller is
retried on another worker of the same pool (a dead worker is marked
unhealthy until it answers polls again, e.g. after Ray restarted it); after
that, the caller gets a final error event. A disaggregated request's first
token (sampled by the context worker) goes to the caller when the
generation worker reports the cache complete and the request admitted
(`cache_ready`; `hold_first_token`, the default), or as soon as the context
worker returns it, before the cache moves. A pull that fails before
`cache_ready` (the context worker died, stalled or the transfer timed out)
runs the request again on another context worker: from the start while the
caller has nothing; once it has tokens, the prompt plus the tokens already
sent is prefilled and the request continues from there. So does a
request the generation worker hands back after a preemption (it cannot
recompute a prompt whose images were encoded elsewhere). When the
caller stops iterating (client disconnect), the request is aborted on every
worker it touched, so both sides free its blocks.

Load, KV events and encoder-cache events are polled from every worker in
the background (`cluster.routing.worker_poller`); the router's own
`tokens_in_flight` bookkeeping keeps `least_loaded` exact between polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.metrics import ServingMetrics
from cluster.routing.context_calls import ContextCalls
from cluster.routing.continuation import Continuation
from cluster.routing.policies import PromptPrefix
from cluster.routing.worker_channel import WorkerChannel
from cluster.routing.worker_poller import UnresponsiveWorkerError, WorkerEndpoint, WorkerPoller
from cluster.routing.worker_pool import WorkerPool, abort_everywhere, dispatch_failed
from engine.errors import RequestFailedError
from engine.messages import (
    ContextRequest,
    ContextResult,
    GenerationRequest,
    PrefetchRequest,
    TokenEvent,
)
from engine.multimodal import ImageInput
from kvcache.hashing import hash_full_blocks, root_hash
from runtime.cancellation import stop_each

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoutingSettings:
    policy: str
    max_local_prefill_length: int
    context_block_size: int
    generation_block_size: int
    max_attempts: int = 2
    # Namespace of block hashes; workers of one cluster share it.
    hash_namespace: str = ""
    # Prompts longer than this (the context workers' prefill chunk) are
    # pulled chunk-pipelined; None: never.
    pipeline_above_tokens: int | None = None
    # `router.first_token_at: admission`: a disaggregated request's first
    # token waits for `cache_ready`; False sends it as the context worker
    # returns it.
    hold_first_token: bool = False
    # A worker that answers no poll for this long has its requests moved.
    stall_timeout_s: float = 30.0
    # A hybrid Mamba model: a cached prefix counts only up to a snapshot.
    hybrid: bool = False
    # Generation workers keep each finished sequence's cache (block reuse on;
    # for a hybrid model with a snapshot at each sequence's end): the router
    # counts it as soon as the sequence ends (`WorkerState.expect_sequence`).
    generation_keeps_sequences: bool = False


class Router:
    def __init__(
        self,
        context: Sequence[WorkerEndpoint],
        generation: Sequence[WorkerEndpoint],
        settings: RoutingSettings,
        metrics: ServingMetrics,
    ) -> None:
        if not generation:
            raise ValueError("the router needs at least one generation worker")
        self._context = WorkerPool(context, settings.policy, metrics)
        self._generation = WorkerPool(generation, settings.policy, metrics)
        self.context = self._context.endpoints
        self.generation = self._generation.endpoints
        self.settings = settings
        self.metrics = metrics
        self._root = root_hash(settings.hash_namespace)
        for endpoints, block_size in (
            (self.context, settings.context_block_size),
            (self.generation, settings.generation_block_size),
        ):
            for endpoint in endpoints:
                endpoint.state.block_size, endpoint.state.hybrid = block_size, settings.hybrid
        self._poller = WorkerPoller(lambda: self.workers, metrics, self._stalled)
        self._channels = {e.name: WorkerChannel(e.name, e.actor) for e in self.generation}
        self._context_calls = {e.name: ContextCalls(e.name, e.actor) for e in self.context}

    @property
    def workers(self) -> list[WorkerEndpoint]:
        return self.context + self.generation

    def start(self) -> None:
        """Start polling load and KV events; call from the serving event loop."""
        self._poller.start()

    async def connect(self) -> None:
        """Open every generation worker's event stream and every context
        worker's call socket (else the first request to each opens them);
        raises `StreamBrokenError` when a stream does not open."""
        await asyncio.gather(
            *(channel.connect() for channel in self._channels.values()),
            *(calls.connect() for calls in self._context_calls.values()),
        )

    def expect_stop(self) -> None:
        """The server is stopping (a signal came): workers going down from
        now on are expected (see `WorkerPoller.expect_stop`)."""
        self._poller.expect_stop()

    async def stop(self) -> None:
        """Stop polling and every worker's stream and calls (`stop_each`)."""
        await stop_each(
            self._poller.stop,
            *(channel.stop for channel in self._channels.values()),
            *(calls.stop for calls in self._context_calls.values()),
        )

    def _stalled(self, endpoint: WorkerEndpoint, stalled_s: float, how: str) -> None:
        """A worker missed a poll or is inside a step (`how`, the poller's
        words): once it has made no progress for `stall_timeout_s`, the
        requests it holds move on (a prefill runs on another context worker;
        a generation request that streamed nothing runs again, one that did
        ends with an error naming the worker)."""
        if stalled_s < self.settings.stall_timeout_s:
            return
        error = UnresponsiveWorkerError(f"{endpoint.name} {how} for {stalled_s:.0f} s")
        if endpoint.name in self._channels:
            self._channels[endpoint.name].fail_sent(error)
        else:
            self._context.give_up(endpoint, error)

    def block_hashes(
        self, prompt: Sequence[int], block_size: int, images: Sequence[ImageInput] = ()
    ) -> PromptPrefix:
        """Chained hashes of the prompt's full blocks, as the workers compute them
        (each with the content hashes of the images overlapping it), with the
        prompt itself for the tail snapshots of a hybrid model."""
        hashes = hash_full_blocks(prompt, block_size, self._root, spans=images)
        return PromptPrefix(hashes, prompt, block_size, self._root, images)

    def _routing_hashes(
        self, prompt: Sequence[int], block_size: int, images: Sequence[ImageInput]
    ) -> Sequence[bytes]:
        """`block_hashes` where routing can use them: while no worker reports a
        cached block (block reuse off, or nothing stored yet) every prefix
        match is 0 whatever the hashes, so none are computed."""
        if not any(e.state.cached_blocks for e in self.workers):
            return []
        return self.block_hashes(prompt, block_size, images)

    def runs_locally(self, prompt: Sequence[int], hashes: Sequence[bytes]) -> bool:
        """Conditional disaggregation: is the uncached prompt short enough?

        `hashes` are the prompt's block hashes at the generation block size;
        the uncached part is what the best generation worker cannot skip
        (for a hybrid model: past its furthest usable snapshot).
        """
        if not self.context:
            return True
        cached = max((e.state.prefix_match(hashes) for e in self.generation), default=0)
        return len(prompt) - cached <= self.settings.max_local_prefill_length

    async def generate(
        self,
        request_id: str,
        prompt: list[int],
        params: Any,
        images: tuple[ImageInput, ...] = (),
    ) -> AsyncGenerator[TokenEvent, None]:
        """Stream a request's `TokenEvent`s; the last one has `finish_reason` set.

        `images` go to the worker that prefills (a context worker, or the
        generation worker of a request run locally), never to one that pulls.
        Raises `RequestFailedError` (or `NoWorkerError`) only before the first
        event; later failures arrive as a final event with `error` set.
        """
        hashes = self._routing_hashes(prompt, self.settings.generation_block_size, images)
        touched: list[WorkerEndpoint] = []
        finished = False
        try:
            if self.runs_locally(prompt, hashes):
                events = self._stream_generation(
                    GenerationRequest(request_id, prompt, params, images=images), hashes, touched
                )
            else:
                events = self._disaggregated(request_id, prompt, params, images, hashes, touched)
            # Closed before the abort below, so a generation submit in flight is in `touched`.
            async with contextlib.aclosing(events):
                async for event in events:
                    finished = event.finished
                    yield event
        finally:
            if not finished:
                abort_everywhere(request_id, touched)

    async def _disaggregated(
        self,
        request_id: str,
        prompt: list[int],
        params: Any,
        images: tuple[ImageInput, ...],
        hashes: Sequence[bytes],
        touched: list[WorkerEndpoint],
    ) -> AsyncGenerator[TokenEvent, None]:
        """Context, then generation. The context worker's first token goes to
        the caller at `cache_ready` (`hold_first_token`) or at once. The
        request runs again from the tokens the caller has (`Continuation`;
        none yet: from the start) when the pull fails (at most
        `max_attempts` times) or when the generation worker hands it back
        after a preemption (a hand-back comes after `cache_ready`, so each
        such round sent at least the context worker's token, and that ends
        within `max_tokens` rounds)."""
        context_hashes = hashes
        if self.settings.context_block_size != self.settings.generation_block_size:
            context_hashes = self._routing_hashes(prompt, self.settings.context_block_size, images)
        resume = Continuation(prompt, params)
        errors: list[str] = []
        target = self._prefetch_target(prompt, hashes, touched)
        while len(errors) < self.settings.max_attempts and resume.resumable:
            context_request = ContextRequest(request_id, resume.prompt, resume.params, images)
            try:
                context = await self._run_context(context_request, context_hashes, touched, target)
            except Exception as exc:  # after a sent token, only an error event may follow
                if not resume.sent:
                    raise
                errors.append(str(exc))
                break
            holder = touched[-1]
            firsts = [resume.event(event) for event in TokenEvent.firsts_of(context)]
            if firsts[-1].finished:
                for first in firsts:
                    yield first
                if target is not None:  # nothing to pull: end the prefetch
                    target.actor.abort.remote(request_id)
                return
            request = GenerationRequest(
                request_id,
                resume.prompt,
                resume.params,
                context,
                tuple(i.without_data() for i in images),
            )
            stream = self._stream_generation(request, hashes, touched, target)
            # The generation worker gets the request while the caller handles
            # the first token, not after.
            submitted = asyncio.ensure_future(anext(stream))
            held = self.settings.hold_first_token
            try:
                if not held:
                    for first in firsts:
                        yield first
                        resume.advance(first.token_ids)
                handed_back = False
                async for event in _started(submitted, stream):
                    handed_back = event.handed_back
                    if event.cache_ready and held:
                        for first in firsts:
                            yield first
                            resume.advance(first.token_ids)
                    elif not (event.cache_ready or handed_back):
                        yield resume.event(event)
                        resume.advance(event.token_ids)
                if not handed_back:
                    return
                self.metrics.handed_back.inc()
            except _PullFailed as failure:
                errors.append(str(failure))
                # The holder may still pin the cache (the puller died): free it.
                abort_everywhere(request_id, [holder])
            finally:
                submitted.cancel()  # the caller left before the first event came
                await asyncio.gather(submitted, return_exceptions=True)
                await stream.aclose()
            target = None
        why = "cache transfer failed: " + "; ".join(errors)
        if not resume.sent:  # held first tokens only: the caller has nothing yet
            raise RequestFailedError(request_id, why)
        yield TokenEvent.ended(request_id, "error", why)

    def _prefetch_target(
        self, prompt: list[int], hashes: Sequence[bytes], touched: list[WorkerEndpoint]
    ) -> WorkerEndpoint | None:
        """The generation worker that pulls a prompt while it prefills, when
        the prompt spans more than one context chunk (else None)."""
        limit = self.settings.pipeline_above_tokens
        if limit is None or len(prompt) <= limit:
            return None
        target = self._generation.pick(hashes, touched)
        touched.append(target)
        self.metrics.routed.labels(target.name, "prefetch").inc()
        return target

    async def _run_context(
        self,
        request: ContextRequest,
        hashes: Sequence[bytes],
        touched: list[WorkerEndpoint],
        prefetch_to: WorkerEndpoint | None = None,
    ) -> ContextResult:
        """Run the context phase; with `prefetch_to`, that generation worker
        starts pulling from the first context worker tried as it prefills."""
        cost = len(request.prompt_token_ids) + 1
        images = [image.content_hash for image in request.images]
        errors: list[str] = []
        for _ in range(self.settings.max_attempts):
            endpoint = self._context.dispatch("context", hashes, touched, images)
            endpoint.state.tokens_in_flight += cost
            if prefetch_to is not None and not errors:
                prefetch = PrefetchRequest(
                    request.request_id,
                    request.prompt_token_ids,
                    endpoint.actor,
                    tuple(i.without_data() for i in request.images),
                )
                prefetch_to.actor.prefetch.remote(prefetch)
            try:
                call = self._context_calls[endpoint.name].prefill(request)
                result: ContextResult = await self._context.answer(endpoint, call)
                return result
            except Exception as exc:  # a dead or silent actor, a failed prefill: try another
                errors.append(dispatch_failed(endpoint, exc, "context", self.metrics))
                if isinstance(exc, UnresponsiveWorkerError):
                    endpoint.actor.abort.remote(request.request_id)  # for when it is back
            finally:
                endpoint.state.tokens_in_flight -= cost
        raise RequestFailedError(request.request_id, "context phase failed: " + "; ".join(errors))

    async def _stream_generation(
        self,
        request: GenerationRequest,
        hashes: Sequence[bytes],
        touched: list[WorkerEndpoint],
        target: WorkerEndpoint | None = None,
    ) -> AsyncGenerator[TokenEvent, None]:
        """Stream from a generation worker. A whole request moves to another
        worker while nothing was streamed (also when its first event is an
        error: the worker failed it, e.g. its engine loop died, before any
        token left); a disaggregated one raises
        `_PullFailed` until its `cache_ready` event (its cache is gone then,
        so only a new prefill can run it), and ends with an error event after.
        `target`: the worker to use (it prefetches the cache)."""
        samples = getattr(request.params, "n", 1)
        cost = len(request.prompt_token_ids) + samples * _max_tokens(request.params)
        phase = "generation" if request.context is not None else "whole"
        attempts = self.settings.max_attempts if request.context is None else 1
        # A worker that pulls the cache encodes nothing: images steer only a
        # request it runs whole.
        images = [i.content_hash for i in request.images] if request.context is None else []
        errors: list[str] = []
        for _ in range(attempts):
            endpoint = self._generation.dispatch(phase, hashes, touched, images, to=target)
            endpoint.state.tokens_in_flight += cost
            streamed = False
            started = time.perf_counter()
            outputs = [request.context.first_token_id] if request.context is not None else []
            try:
                channel = self._channels[endpoint.name]
                async with contextlib.aclosing(channel.stream(request)) as events:
                    async for event in events:
                        if not streamed and event.error is not None:
                            raise RequestFailedError(request.request_id, event.error)
                        if event.cache_ready and request.context is not None:
                            self._record_transfer(request.context, started)
                        streamed = True
                        if event.sample == 0:  # what routing counts on: sample 0's cache
                            outputs += event.token_ids
                            ended = event.finish_reason or event.sample_finish_reason
                            if ended in ("stop", "length"):
                                self._kept(endpoint, request, outputs)
                        yield event
                        if event.finished:
                            return
                raise RequestFailedError(request.request_id, "the stream ended unfinished")
            except Exception as exc:
                failure = dispatch_failed(endpoint, exc, "generation", self.metrics)
                if streamed:
                    yield TokenEvent.ended(request.request_id, "error", failure)
                    return
                if request.context is not None:
                    raise _PullFailed(failure) from exc
                errors.append(failure)
            finally:
                endpoint.state.tokens_in_flight -= cost
        raise RequestFailedError(
            request.request_id, "generation phase failed: " + "; ".join(errors)
        )

    def _kept(
        self, endpoint: WorkerEndpoint, request: GenerationRequest, outputs: list[int]
    ) -> None:
        """A sequence ended on `endpoint`: with reuse there, the cache of all
        its tokens but the last (never fed back) stays, for its next turn."""
        if not self.settings.generation_keeps_sequences:
            return
        tokens = [*request.prompt_token_ids, *outputs]
        prefix = self.block_hashes(tokens, self.settings.generation_block_size, request.images)
        endpoint.state.expect_sequence(prefix, len(tokens) - 1)

    def _record_transfer(self, context: ContextResult, started: float) -> None:
        """The pull ends before the generation worker's first token: time it,
        and count the bytes the handles addressed, every context rank's."""
        self.metrics.transfer_seconds.observe(time.perf_counter() - started)
        self.metrics.transfer_bytes.inc(sum(h.regions.num_bytes for h in context.all_handles))


class _PullFailed(Exception):
    """A disaggregated request failed before its cache arrived on the
    generation side; its prefill may run again."""


def _max_tokens(params: Any) -> int:
    return int(getattr(params, "max_tokens", 0) or 0)


async def _started(
    first: Awaitable[TokenEvent], rest: AsyncIterator[TokenEvent]
) -> AsyncIterator[TokenEvent]:
    """A stream whose first event is already being awaited (`first`), then the rest."""
    yield await first
    async for event in rest:
        yield event
