"""The OpenAI-compatible HTTP server (FastAPI).

Routes: `GET /health`, `GET /metrics` (Prometheus), `GET /v1/models`,
`POST /v1/completions` and `POST /v1/chat/completions`, each streaming (SSE)
or not. Requests are validated and tokenized here, once (a long prompt off
the event loop, `cluster.prompt_tokenizer`); the router and the workers only
ever see token ids. A client that disconnects cancels its
request: the response task is cancelled, which closes the router stream and
aborts the request on both workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster import openai_format as fmt
from cluster.admission import DEFAULT_MAX_QUEUED_REQUESTS, Admission
from cluster.api_errors import (
    APIError,
    handle_api_error,
    handle_http_error,
    handle_validation_error,
)
from cluster.completion import CompletionFailedError, Delta, PreparedRequest, stream_completion
from cluster.http_guards import DEFAULT_MAX_BODY_BYTES, RequestGuard
from cluster.image_prompt import (
    ImageSupport,
    load_chat_images,
    place_images,
    refuse_completion_images,
)
from cluster.media import MediaConfig
from cluster.metrics import ServingMetrics
from cluster.policies import NoWorkerError
from cluster.prompt_tokenizer import PromptTokenizer
from cluster.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from cluster.router import Router
from engine.errors import RequestFailedError
from engine.multimodal import ImageInput
from engine.sampling import SamplingParams

_DISCONNECT_POLL_S = 0.25


@dataclass(frozen=True)
class ServedModel:
    """The model behind the endpoint.

    name: the id `/v1/models` lists and requests must name.
    aliases: other accepted names (the checkpoint path).
    max_model_len: most prompt + output tokens of one request.
    """

    name: str
    tokenizer: Any  # models.tokenizer: encode / decode / apply_chat_template
    max_model_len: int
    vocab_size: int
    aliases: tuple[str, ...] = ()
    images: ImageSupport | None = None  # None: the model takes no images
    media: MediaConfig = MediaConfig()


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
    app.add_middleware(RequestGuard, api_key=limits.api_key, max_body_bytes=limits.max_body_bytes)
    app.add_exception_handler(APIError, handle_api_error)
    app.add_exception_handler(RequestValidationError, handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, handle_http_error)
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/metrics", api.metrics_text, methods=["GET"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    return app


@dataclass(frozen=True)
class _Shape:
    """How one endpoint renders its output.

    opening: SSE lines sent before the first token (chat's role chunk).
    chunk / whole: the SSE line of one delta / the body for all of them.
    """

    endpoint: str
    meta: fmt.ResponseMeta
    opening: list[str]
    chunk: Callable[[Delta], str]
    whole: Callable[[Delta], dict[str, Any]]
    chunk_object: str


class _OpenAIRoutes:
    def __init__(
        self, router: Router, model: ServedModel, metrics: ServingMetrics, admission: Admission
    ) -> None:
        self.router = router
        self.model = model
        self.metrics = metrics
        self.admission = admission
        self.prompts = PromptTokenizer(model.tokenizer)
        self.created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        self.router.start()
        try:
            yield
        finally:
            self.prompts.close()
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
        card = {"id": self.model.name, "object": "model", "created": self.created}
        card |= {"owned_by": "disagg", "max_model_len": self.model.max_model_len}
        return {"object": "list", "data": [card]}

    async def completions(self, body: CompletionRequest, http: Request) -> Response:
        self._check_model(body.model)
        return await self._serve("completions", lambda: self._completion(body), body, http)

    async def chat_completions(self, body: ChatCompletionRequest, http: Request) -> Response:
        self._check_model(body.model)
        return await self._serve("chat", lambda: self._chat_completion(body), body, http)

    # --- request preparation -------------------------------------------------

    async def _completion(self, body: CompletionRequest) -> tuple[_Shape, PreparedRequest]:
        if isinstance(body.prompt, str):
            prompt = await self.prompts.encode(body.prompt)
        else:
            prompt = list(body.prompt)
        refuse_completion_images(prompt, self.model.images)
        prepared = self._prepare("cmpl", body, prompt, body.max_tokens, body.logprobs)
        meta = fmt.ResponseMeta(prepared.request_id, int(time.time()), self.model.name)
        num_top = body.logprobs or 0
        tokenizer = self.model.tokenizer
        writer = fmt.ChunkWriter(meta, "text_completion")
        offset = 0

        def chunk(delta: Delta) -> str:
            nonlocal offset
            start, offset = offset, offset + len(delta.text)
            if delta.logprobs is None:
                return writer.text_line(delta.text, delta.finish_reason)
            logprobs = fmt.completion_logprobs(delta, tokenizer, num_top, start)
            return writer.line(fmt.completion_choice(delta.text, delta.finish_reason, logprobs))

        def whole(delta: Delta) -> dict[str, Any]:
            logprobs = fmt.completion_logprobs(delta, tokenizer, num_top, 0)
            return fmt.completion_body(meta, delta, logprobs)

        return _Shape("completions", meta, [], chunk, whole, "text_completion"), prepared

    async def _chat_completion(self, body: ChatCompletionRequest) -> tuple[_Shape, PreparedRequest]:
        images = await load_chat_images(body, self.model.images, self.model.media)
        messages = body.template_messages(images.texts)
        chars = sum(len(message["content"]) for message in messages)
        prompt = await self.prompts.run(chars, self._render_chat, messages)
        placed: tuple[ImageInput, ...] = ()
        if self.model.images is not None:
            placed = place_images(prompt, images.inputs, self.model.images.vision.image_token_id)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prepared = self._prepare("chatcmpl", body, prompt, body.output_limit, logprobs, placed)
        meta = fmt.ResponseMeta(prepared.request_id, int(time.time()), self.model.name)
        tokenizer = self.model.tokenizer
        num_top = body.top_logprobs or 0
        writer = fmt.ChunkWriter(meta, "chat.completion.chunk")
        opening = [writer.line(fmt.chat_choice({"role": "assistant", "content": ""}, None))]

        def chunk(delta: Delta) -> str:
            if delta.logprobs is None:
                return writer.content_line(delta.text, delta.finish_reason)
            content = {"content": delta.text} if delta.text else {}
            lp = fmt.chat_logprobs(delta, tokenizer, num_top)
            return writer.line(fmt.chat_choice(content, delta.finish_reason, lp))

        def whole(delta: Delta) -> dict[str, Any]:
            return fmt.chat_body(meta, delta, fmt.chat_logprobs(delta, tokenizer, num_top))

        return _Shape("chat", meta, opening, chunk, whole, "chat.completion.chunk"), prepared

    def _check_model(self, name: str) -> None:
        if name != self.model.name and name not in self.model.aliases:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model.name!r}",
                param="model",
                code="model_not_found",
            )

    def _render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt's token ids (on `self.prompts`' thread when long)."""
        try:
            rendered = self.model.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True
            )
        except Exception as exc:  # a template error names the message it disliked
            raise APIError(
                400, f"messages: cannot apply the chat template: {exc}", "messages"
            ) from exc
        if isinstance(rendered, str):
            return list(self.model.tokenizer.encode(rendered, add_special_tokens=False))
        return list(rendered)

    def _prepare(
        self,
        prefix: str,
        body: SamplingFields,
        prompt: list[int],
        max_tokens: int | None,
        logprobs: int | None,
        images: tuple[ImageInput, ...] = (),
    ) -> PreparedRequest:
        limit = self.model.max_model_len
        if not prompt:
            raise APIError(400, "prompt: the prompt is empty after tokenization", "prompt")
        if max(prompt) >= self.model.vocab_size:
            raise APIError(
                400, f"prompt: token ids must be below the vocabulary size {self.model.vocab_size}",
                "prompt",
            )  # fmt: skip
        if len(prompt) >= limit:
            raise APIError(
                400,
                f"prompt: {len(prompt)} tokens leave no room for output; this model "
                f"takes at most {limit} tokens of prompt and output together",
                "prompt",
                "context_length_exceeded",
            )
        room = limit - len(prompt)
        if max_tokens is not None and max_tokens > room:
            raise APIError(
                400,
                f"max_tokens: {max_tokens} output tokens do not fit after a {len(prompt)}-token "
                f"prompt (at most {limit} in total); ask for at most {room}",
                "max_tokens",
                "context_length_exceeded",
            )
        return PreparedRequest(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            prompt_token_ids=prompt,
            params=_sampling_params(body, max_tokens or room, logprobs),
            stop_strings=tuple(body.stop_strings),
            include_stop_str_in_output=body.include_stop_str_in_output,
            images=images,
        )

    # --- responding ------------------------------------------------------------

    async def _serve(
        self,
        endpoint: str,
        prepare: Callable[[], Awaitable[tuple[_Shape, PreparedRequest]]],
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
        self, shape: _Shape, prepared: PreparedRequest, body: SamplingFields, http: Request
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
            return JSONResponse(shape.whole(fmt.merge([first, *rest])))
        finish = _Once(self._finished)
        events = self._sse(shape, first, deltas, body.include_usage, finish)
        return _ClosingStream(events, finish, media_type="text/event-stream")

    async def _sse(
        self,
        shape: _Shape,
        first: Delta,
        deltas: AsyncGenerator[Delta, None],
        include_usage: bool,
        finish: Callable[[], None],
    ) -> AsyncIterator[str]:
        status = "200"
        try:
            for line in shape.opening:
                yield line
            last = first
            yield shape.chunk(first)
            if first.finish_reason is None:
                async for delta in deltas:
                    last = delta
                    yield shape.chunk(delta)
            if include_usage:
                yield fmt.sse(fmt.usage_chunk(shape.meta, shape.chunk_object, last))
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


def _sampling_params(body: SamplingFields, max_tokens: int, logprobs: int | None) -> Any:
    try:
        return _build_sampling_params(body, max_tokens, logprobs)
    except ValueError as exc:  # SamplingParams names the field it rejects
        raise APIError(400, str(exc), code="invalid_value") from exc


def _build_sampling_params(
    body: SamplingFields, max_tokens: int, logprobs: int | None
) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        min_p=body.min_p,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        stop_token_ids=tuple(body.stop_token_ids),
        stop=tuple(body.stop_strings),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        include_stop_str_in_output=body.include_stop_str_in_output,
    )
