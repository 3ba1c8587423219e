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
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


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


async def stream_completion(
    router: Router, tokenizer: Any, metrics: ServingMetrics, request: PreparedRequest
) -> AsyncGenerator[Delta, None]:
    """Deltas of one request (`tokenizer` is a `models.tokenizer.Tokenizer`); the last has `finish_reason` "stop" or "length".

    Raises `CompletionFailedError` when a worker reports an error or the
    request was aborted, `NoWorkerError` / `RequestFailedError` when no worker
    could take it.
    """
    # Decoding continues the prompt so a first token's leading space renders
    # as it would mid-text.
    detokenizer = tokenizer.detokenizer(request.prompt_token_ids)
    stops = StopStringFilter(request.stop_strings, request.include_stop_str_in_output)
    output_ids: list[int] = []
    latency = _Latency(metrics, request.arrival)
    events = router.generate(
        request.request_id, request.prompt_token_ids, request.params, request.images
    )
    num_cached = 0
    try:
        async for event in events:
            if event.finish_reason in ("error", "abort"):
                raise CompletionFailedError(event.error or f"request {event.finish_reason}ed")
            if event.token_ids:
                latency.tokens(len(event.token_ids))
            num_cached = max(num_cached, event.num_cached_tokens)
            output_ids.extend(event.token_ids)
            text = stops.add("".join(map(detokenizer.push, event.token_ids)))
            finish = event.finish_reason
            if stops.stopped:
                finish = "stop"
            elif finish is not None:
                text += stops.add(detokenizer.finish())
                text += stops.finish()
            yield Delta(
                text=text,
                token_ids=list(event.token_ids),
                logprobs=event.logprobs,
                top_logprobs=event.top_logprobs,
                finish_reason=finish,
                num_prompt_tokens=len(request.prompt_token_ids),
                num_output_tokens=len(output_ids),
                num_cached_tokens=num_cached,
            )
            if finish is not None:
                latency.done()
                metrics.prompt_tokens.inc(len(request.prompt_token_ids))
                metrics.cached_prompt_tokens.observe(num_cached)
                metrics.generation_tokens.inc(len(output_ids))
                return
        raise CompletionFailedError("the token stream ended without a finish reason")
    finally:
        await events.aclose()
