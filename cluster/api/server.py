"""The OpenAI-compatible HTTP server (FastAPI).

Routes: `GET /health`, `GET /metrics` (Prometheus), `GET /v1/models`,
`POST /v1/completions` and `POST /v1/chat/completions`, each streaming (SSE)
or not. A request takes an admission slot on arrival (429 when none is
free), is prepared once (`cluster.api.request_prep`: tokenized, checked), and
holds the slot until its response ends; the router and the workers only
ever see token ids. A client that disconnects cancels its request: the
response task is cancelled, which closes the router stream and aborts the
request on both workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.api import openai_format as fmt
from cluster.api.admission import DEFAULT_MAX_QUEUED_REQUESTS, Admission
from cluster.api.api_errors import (
    APIError,
    handle_api_error,
    handle_http_error,
    handle_validation_error,
)
from cluster.api.completion import CompletionFailedError, Delta, PreparedRequest, stream_completion
from cluster.api.guards import DEFAULT_MAX_BODY_BYTES, RequestGuard
from cluster.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Prompt,
    SamplingFields,
    TokenizeRequest,
)
from cluster.api.request_prep import RequestPreparer, ResponseShape, ServedModel
from cluster.metrics import ServingMetrics
from cluster.routing.policies import NoWorkerError
from cluster.routing.router import Router
from engine.errors import RequestFailedError

_DISCONNECT_POLL_S = 0.25


@dataclass(frozen=True)
class ServerLimits:
    """What the HTTP edge refuses before any worker sees a request.

    api_key: bearer token the `/v1` routes require; None leaves them open.
    max_body_bytes: larger request bodies get 413.
    max_queued_requests: completions in flight at once; more get 429.
    """

    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS


def build_app(
    router: Router, model: ServedModel, metrics: ServingMetrics, limits: ServerLimits | None = None
) -> FastAPI:
    """The FastAPI app; the router's pollers start and stop with it."""
    limits = limits or ServerLimits()
    api = _OpenAIRoutes(router, model, metrics, Admission(limits.max_queued_requests))
    app = FastAPI(title="disagg", lifespan=api.lifespan)

    def count(status: int, code: str | None) -> None:
        metrics.error_responses.labels(str(status), code or "none").inc()

    app.add_middleware(
        RequestGuard,
        api_key=limits.api_key,
        max_body_bytes=limits.max_body_bytes,
        on_refused=count,
    )
    app.add_exception_handler(APIError, _counted(handle_api_error, count))
    app.add_exception_handler(RequestValidationError, _counted(handle_validation_error, count))
    app.add_exception_handler(StarletteHTTPException, _counted(handle_http_error, count))
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/metrics", api.metrics_text, methods=["GET"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", api.model_card, methods=["GET"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    # vLLM's extra routes, in its shapes.
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"])
    app.add_api_route("/version", api.version, methods=["GET"])
    return app


class _OpenAIRoutes:
    def __init__(
        self, router: Router, model: ServedModel, metrics: ServingMetrics, admission: Admission
    ) -> None:
        self.router = router
        self.model = model
        self.metrics = metrics
        self.admission = admission
        self.prep = RequestPreparer(model)
        self.created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        self.router.start()
        try:
            yield
        finally:
            self.prep.close()
            await self.router.stop()

    async def health(self) -> JSONResponse:
        pools = {"context": self.router.context, "generation": self.router.generation}
        status = {name: sum(e.state.healthy for e in pool) for name, pool in pools.items() if pool}
        ok = all(count > 0 for count in status.values())
        body = {"status": "ok" if ok else "unavailable", "healthy_workers": status}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics_text(self) -> Response:
        return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4")

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._card()]}

    async def model_card(self, model_id: str) -> dict[str, Any]:
        """`GET /v1/models/{id}` (`client.models.retrieve`): the card, or a 404."""
        self.prep.check_model(model_id)
        return self._card()

    def _card(self) -> dict[str, Any]:
        card = {"id": self.model.name, "object": "model", "created": self.created}
        return card | {"owned_by": "disagg", "max_model_len": self.model.max_model_len}

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        return self.prep.tokenize(body)

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        return self.prep.detokenize(body)

    async def version(self) -> dict[str, str]:
        return {"version": importlib.metadata.version("disagg")}

    async def completions(self, body: CompletionRequest, http: Request) -> Response:
        self.prep.check_model(body.model)
        prompts = body.prompt_list()
        if prompts is not None:
            return await self._listed_completions(body, prompts, http)
        return await self._serve("completions", lambda: self.prep.completion(body), body, http)

    async def _listed_completions(
        self, body: CompletionRequest, prompts: list[Prompt], http: Request
    ) -> Response:
        """A list of prompts, as OpenAI answers it: each prompt runs as a
        request of its own (admitted, prepared and routed apart, all at
        once), and the answer lists their choices by position with their
        usage summed. One failing fails the whole answer and ends the rest."""

        async def one(prompt: Prompt) -> dict[str, Any]:
            single = body.model_copy(update={"prompt": prompt})
            response = await self._serve(
                "completions", lambda: self.prep.completion(single), single, http
            )
            return json.loads(bytes(response.body))  # type: ignore[no-any-return]

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(prompt)) for prompt in prompts]
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None
        answers = [task.result() for task in tasks]
        # OpenAI's order: prompt i's choice j has index i * n + j.
        choices = [
            choice | {"index": i * body.n + choice["index"]}
            for i, answer in enumerate(answers)
            for choice in answer["choices"]
        ]
        return JSONResponse(answers[0] | {"choices": choices, "usage": _summed_usage(answers)})

    async def chat_completions(self, body: ChatCompletionRequest, http: Request) -> Response:
        self.prep.check_model(body.model)
        return await self._serve("chat", lambda: self.prep.chat(body), body, http)

    # --- responding ------------------------------------------------------------

    async def _serve(
        self,
        endpoint: str,
        prepare: Callable[[], Awaitable[tuple[ResponseShape, PreparedRequest]]],
        body: SamplingFields,
        http: Request,
    ) -> Response:
        """Admit the request (429 when the server is full), then prepare it
        (images, tokenization, checks) and respond: its admission slot is
        held from arrival until the response ends, preparation included."""
        try:
            self.admission.acquire()
        except APIError:
            self.metrics.requests.labels(endpoint, "429").inc()
            raise
        try:
            shape, prepared = await prepare()
        except BaseException:
            self.admission.release()
            raise
        return await self._respond(shape, prepared, body, http)

    async def _respond(
        self, shape: ResponseShape, prepared: PreparedRequest, body: SamplingFields, http: Request
    ) -> Response:
        """Stream or collect the request's output; frees its admission slot
        (taken by `_serve`) when it ends."""
        endpoint = shape.endpoint
        deltas = stream_completion(self.router, self.model.tokenizer, self.metrics, prepared)
        self.metrics.in_flight.inc()
        try:
            # The first delta arrives before any byte is sent, so a request no
            # worker can take still gets a proper status code.
            first = await self._guard(endpoint, anext(deltas))
        except BaseException:
            self._finished()
            await deltas.aclose()
            raise
        if not body.stream:
            try:
                rest = await self._until_disconnect(http, _collect(deltas))
            except APIError as exc:
                self.metrics.requests.labels(endpoint, str(exc.status)).inc()
                raise
            finally:
                self._finished()
            self.metrics.requests.labels(endpoint, "200").inc()
            return JSONResponse(_whole(shape, [first, *rest]))
        finish = _Once(self._finished)
        events = self._sse(shape, first, deltas, body.include_usage, finish)
        return _ClosingStream(events, finish, media_type="text/event-stream")

    async def _sse(
        self,
        shape: ResponseShape,
        first: Delta,
        deltas: AsyncGenerator[Delta, None],
        include_usage: bool,
        finish: Callable[[], None],
    ) -> AsyncIterator[str]:
        status = "200"
        try:
            for line in shape.opening:
                yield line
            last = {first.index: first}  # each choice's latest delta
            yield shape.chunk(first)
            async for delta in deltas:  # ends with the last choice's finish
                last[delta.index] = delta
                yield shape.chunk(delta)
            if include_usage:
                usage = fmt.summed(list(last.values()))
                yield fmt.sse(fmt.usage_chunk(shape.meta, shape.chunk_object, usage))
        except (CompletionFailedError, RequestFailedError, NoWorkerError) as exc:
            status = "500"
            yield fmt.sse(APIError(500, str(exc), code="generation_failed").body())
        except asyncio.CancelledError:
            status = "499"  # the client went away
            raise
        finally:
            finish()
            self.metrics.requests.labels(shape.endpoint, status).inc()
            await deltas.aclose()
        yield fmt.SSE_DONE

    def _finished(self) -> None:
        """A request admitted by `_respond` is over: free its admission slot."""
        self.metrics.in_flight.dec()
        self.admission.release()

    async def _guard(self, endpoint: str, step: Awaitable[Delta]) -> Delta:
        """Await the first delta, mapping cluster failures to OpenAI errors."""
        try:
            return await step
        except NoWorkerError as exc:
            self.metrics.requests.labels(endpoint, "503").inc()
            raise APIError(503, str(exc), code="no_healthy_worker") from exc
        except (CompletionFailedError, RequestFailedError) as exc:
            self.metrics.requests.labels(endpoint, "500").inc()
            raise APIError(500, str(exc), code="generation_failed") from exc

    async def _until_disconnect(self, http: Request, work: Awaitable[list[Delta]]) -> list[Delta]:
        """Run `work`, cancelling it (and with it the request) if the client leaves."""
        task = asyncio.ensure_future(work)
        while not task.done():
            await asyncio.wait([task], timeout=_DISCONNECT_POLL_S)
            if not task.done() and await http.is_disconnected():
                task.cancel()
                raise APIError(400, "the client disconnected", code="client_disconnected")
        try:
            return task.result()
        except (CompletionFailedError, RequestFailedError, NoWorkerError) as exc:
            raise APIError(500, str(exc), code="generation_failed") from exc


def _counted(
    handler: Callable[[Request, Exception], Awaitable[JSONResponse]],
    count: Callable[[int, str | None], None],
) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:
    """`handler`, counting each error response it makes by status and code."""

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        response = await handler(request, exc)
        count(response.status_code, json.loads(bytes(response.body))["error"].get("code"))
        return response

    return handle


def _whole(shape: ResponseShape, deltas: list[Delta]) -> dict[str, Any]:
    """The whole answer of a finished request: one choice per sample, the
    prompt counted once in its usage and every choice's tokens summed."""
    merged = fmt.merge_choices(deltas)
    bodies = [shape.whole(delta) for delta in merged]
    choices = [
        body["choices"][0] | {"index": d.index} for body, d in zip(bodies, merged, strict=True)
    ]
    return bodies[0] | {"choices": choices, "usage": fmt.usage(fmt.summed(merged))}


def _summed_usage(answers: list[dict[str, Any]]) -> dict[str, Any]:
    usages = [answer["usage"] for answer in answers]
    total = {
        key: sum(u[key] for u in usages) for key in usages[0] if key != "prompt_tokens_details"
    }
    cached = [
        u["prompt_tokens_details"]["cached_tokens"]
        for u in usages
        if u.get("prompt_tokens_details")
    ]
    if cached:
        total["prompt_tokens_details"] = {"cached_tokens": sum(cached)}
    return total


class _Once:
    """Calls `fn` on the first call only."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn: Callable[[], None] | None = fn

    def __call__(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()


class _ClosingStream(StreamingResponse):
    """A streaming response that runs `on_close` however it ends.

    A client that disconnects before the first chunk means the body
    generator never starts, so its `finally` never runs; this frees the
    request's admission slot in that case too (`on_close` is idempotent).
    """

    def __init__(
        self, content: AsyncIterator[str], on_close: Callable[[], None], media_type: str
    ) -> None:
        super().__init__(content, media_type=media_type)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _collect(deltas: AsyncIterator[Delta]) -> list[Delta]:
    return [delta async for delta in deltas]
