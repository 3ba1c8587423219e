"""One completion from the HTTP server's point of view: router events -> text deltas.

`stream_completion` drives `Router.generate`, turns token ids into settled
text (stop strings included), and records the client-facing latencies: time
to first token, inter-token latency and end-to-end latency. Leaving the
iteration early (client gone, stop string seen) closes the router stream,
which aborts the request on every worker it touched.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from cluster.api.stop_strings import StopStringFilter
from cluster.metrics import ServingMetrics
from cluster.routing.router import Router
from engine.multimodal import ImageInput


class CompletionFailedError(RuntimeError):
    """The cluster could not finish the request; the message says why."""


@dataclass(frozen=True)
class PreparedRequest:
    """A validated, tokenized request, ready for the router."""

    request_id: str
    prompt_token_ids: list[int]
    params: Any  # engine.sampling.SamplingParams
    stop_strings: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    arrival: float = field(default_factory=time.perf_counter)
    images: tuple[ImageInput, ...] = ()  # for the worker that prefills


@dataclass(frozen=True)
class Delta:
    """New output of one request since the previous delta."""

    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # of this choice, so far
    num_cached_tokens: int = 0
    index: int = 0  # the choice (sample) it belongs to


class _Latency:
    """TTFT, ITL and e2e observations of one request."""

    def __init__(self, metrics: ServingMetrics, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.last: float | None = None

    def tokens(self, count: int) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrival)
        elif count:
            # Tokens that arrive together share the gap since the last ones.
            gap = (now - self.last) / count
            for _ in range(count):
                self.metrics.itl.observe(gap)
        self.last = now

    def done(self) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)


class _Choice:
    """One sample's text so far: its detokenizer, stop strings and tokens."""

    def __init__(self, tokenizer: Any, request: PreparedRequest) -> None:
        # Decoding continues the prompt so a first token's leading space renders
        # as it would mid-text.
        self.detokenizer = tokenizer.detokenizer(request.prompt_token_ids)
        self.stops = StopStringFilter(request.stop_strings, request.include_stop_str_in_output)
        self.num_tokens = 0
        self.finished = False

    def add(self, token_ids: list[int], finish: str | None) -> tuple[str, str | None]:
        """The settled text of `token_ids` and the choice's finish reason
        (None while it runs on)."""
        self.num_tokens += len(token_ids)
        text = self.stops.add("".join(map(self.detokenizer.push, token_ids)))
        if self.stops.stopped:
            finish = "stop"
        elif finish is not None:
            text += self.stops.add(self.detokenizer.finish())
            text += self.stops.finish()
        self.finished = finish is not None
        return text, finish


async def stream_completion(
    router: Router, tokenizer: Any, metrics: ServingMetrics, request: PreparedRequest
) -> AsyncGenerator[Delta, None]:
    """Deltas of one request (`tokenizer` is a `models.tokenizer.Tokenizer`),
    each of one choice (`Delta.index`, the sample); the last delta of each
    choice has `finish_reason` "stop" or "length". It ends once every choice
    has finished.

    Raises `CompletionFailedError` when a worker reports an error or the
    request was aborted, `NoWorkerError` / `RequestFailedError` when no worker
    could take it.
    """
    num_choices = getattr(request.params, "n", 1)
    choices = [_Choice(tokenizer, request) for _ in range(num_choices)]
    latency = _Latency(metrics, request.arrival)
    events = router.generate(
        request.request_id, request.prompt_token_ids, request.params, request.images
    )
    num_cached = 0
    try:
        async for event in events:
            ended = event.finish_reason or event.sample_finish_reason
            if ended in ("error", "abort"):
                raise CompletionFailedError(event.error or f"request {ended}ed")
            choice = choices[event.sample]
            if choice.finished:  # it met a stop string; its sample runs on
                continue
            if event.token_ids:
                latency.tokens(len(event.token_ids))
            num_cached = max(num_cached, event.num_cached_tokens)
            text, finish = choice.add(event.token_ids, ended)
            yield Delta(
                text=text,
                token_ids=list(event.token_ids),
                logprobs=event.logprobs,
                top_logprobs=event.top_logprobs,
                finish_reason=finish,
                num_prompt_tokens=len(request.prompt_token_ids),
                num_output_tokens=choice.num_tokens,
                num_cached_tokens=num_cached,
                index=event.sample,
            )
            if all(c.finished for c in choices):
                latency.done()
                metrics.prompt_tokens.inc(len(request.prompt_token_ids))
                metrics.cached_prompt_tokens.observe(num_cached)
                metrics.generation_tokens.inc(sum(c.num_tokens for c in choices))
                return
        raise CompletionFailedError("the token stream ended without a finish reason")
    finally:
        await events.aclose()
