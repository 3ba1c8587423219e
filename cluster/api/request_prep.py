"""From a validated OpenAI request to a `PreparedRequest` and how to render its output.

The server admits a request, then prepares it here: chat images fetched and
placed, the prompt tokenized (a long one off the event loop,
`cluster.api.prompt_tokenizer`), its length and sampling fields checked against
the model (a 400 naming the field otherwise), and the endpoint's rendering
of deltas (SSE chunk lines, the whole body) bound to the request's id.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from cluster.api import openai_format as fmt
from cluster.api.api_errors import APIError
from cluster.api.completion import Delta, PreparedRequest
from cluster.api.image_prompt import (
    ImageSupport,
    load_chat_images,
    place_images,
    refuse_completion_images,
)
from cluster.api.media import MediaConfig
from cluster.api.prompt_tokenizer import PromptTokenizer
from cluster.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TextPart,
    TokenizeRequest,
)
from cluster.api.structured import StructuredError, grammar_of
from cluster.api.tools import (
    ToolCalling,
    ToolError,
    declares_tools,
    template_tools,
    tool_calling,
)
from engine.grammar import GrammarSpec
from engine.multimodal import ImageInput
from engine.sampling import SamplingParams


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
class ResponseShape:
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


class RequestPreparer:
    """Prepares requests for one served model (see the module docstring)."""

    def __init__(self, model: ServedModel) -> None:
        self.model = model
        self.prompts = PromptTokenizer(model.tokenizer)

    def close(self) -> None:
        self.prompts.close()

    async def completion(self, body: CompletionRequest) -> tuple[ResponseShape, PreparedRequest]:
        if isinstance(body.prompt, str):
            prompt = await self.prompts.encode(body.prompt)
        else:  # one prompt of token ids: a listed prompt runs as one request each
            assert body.prompt_list() is None
            prompt = list(body.prompt)  # type: ignore[arg-type]
        refuse_completion_images(prompt, self.model.images)
        prepared = self._prepare("cmpl", body, prompt, body.max_tokens, body.logprobs)
        meta = fmt.ResponseMeta(prepared.request_id, int(time.time()), self.model.name)
        num_top = body.logprobs or 0
        tokenizer = self.model.tokenizer
        as_ids = body.return_tokens_as_token_ids
        writer = fmt.ChunkWriter(meta, "text_completion")

        offsets = [0] * body.n  # each choice's text so far

        def chunk(delta: Delta) -> str:
            start = offsets[delta.index]
            offsets[delta.index] += len(delta.text)
            if delta.logprobs is None:
                return writer.text_line(delta.text, delta.finish_reason, delta.index)
            logprobs = fmt.completion_logprobs(delta, tokenizer, num_top, start, as_ids)
            choice = fmt.completion_choice(delta.text, delta.finish_reason, logprobs, delta.index)
            return writer.line(choice)

        def whole(delta: Delta) -> dict[str, Any]:
            logprobs = fmt.completion_logprobs(delta, tokenizer, num_top, 0, as_ids)
            return fmt.completion_body(meta, delta, logprobs)

        return ResponseShape("completions", meta, [], chunk, whole, "text_completion"), prepared

    async def chat(self, body: ChatCompletionRequest) -> tuple[ResponseShape, PreparedRequest]:
        try:
            template = getattr(self.model.tokenizer, "chat_template", None)
            declared = bool(body.tools) and declares_tools(template)  # read only with tools
            calling = tool_calling(body.tools, body.tool_choice, body.parallel_tool_calls, declared)
        except ToolError as exc:
            raise APIError(400, str(exc), exc.param, "invalid_value") from exc
        images = await load_chat_images(body, self.model.images, self.model.media)
        messages = body.template_messages(images.texts)
        chars = sum(len(message["content"]) for message in messages)
        tools = template_tools(body.tools) if calling is not None else None
        prompt = await self.prompts.run(chars, self._render_chat, messages, True, tools)
        placed: tuple[ImageInput, ...] = ()
        if self.model.images is not None:
            placed = place_images(prompt, images.inputs, self.model.images.vision.image_token_id)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prepared = self._prepare(
            "chatcmpl", body, prompt, body.output_limit, logprobs, placed, calling
        )
        meta = fmt.ResponseMeta(prepared.request_id, int(time.time()), self.model.name)
        tokenizer = self.model.tokenizer
        num_top = body.top_logprobs or 0
        as_ids = body.return_tokens_as_token_ids
        writer = fmt.ChunkWriter(meta, "chat.completion.chunk")
        role = {"role": "assistant", "content": ""}
        opening = [writer.line(fmt.chat_choice(role, None, index=i)) for i in range(body.n)]

        def chunk(delta: Delta) -> str:
            if delta.logprobs is None:
                return writer.content_line(delta.text, delta.finish_reason, delta.index)
            content = {"content": delta.text} if delta.text else {}
            lp = fmt.chat_logprobs(delta, tokenizer, num_top, as_ids)
            return writer.line(fmt.chat_choice(content, delta.finish_reason, lp, delta.index))

        def whole(delta: Delta) -> dict[str, Any]:
            return fmt.chat_body(meta, delta, fmt.chat_logprobs(delta, tokenizer, num_top, as_ids))

        shape = ResponseShape("chat", meta, opening, chunk, whole, "chat.completion.chunk")
        if calling is not None:
            tool_chunk, tool_whole = _tool_rendering(calling, writer, whole, body.n)
            shape = replace(shape, chunk=tool_chunk, whole=tool_whole)
        return shape, prepared

    def check_model(self, name: str) -> None:
        if name != self.model.name and name not in self.model.aliases:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model.name!r}",
                param="model",
                code="model_not_found",
            )

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's `/tokenize` answer: the ids a completion or chat request
        with this input would be prefilled with."""
        if body.model is not None:
            self.check_model(body.model)
        tokenizer = self.model.tokenizer
        if body.prompt is not None:
            ids = list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        else:
            assert body.messages is not None
            messages = [
                {
                    "role": m.role,
                    "content": "".join(p.text for p in m.parts() if isinstance(p, TextPart)),
                }
                for m in body.messages
            ]
            ids = self._render_chat(messages, body.add_generation_prompt)
        answer: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.model.max_model_len,
            "tokens": ids,
        }
        if body.return_token_strs:
            answer["token_strs"] = [fmt.token_text(tokenizer.token_bytes(t)) for t in ids]
        return answer

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            self.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < self.model.vocab_size]
        if bad:
            raise APIError(
                400,
                f"tokens: ids must be in [0, {self.model.vocab_size}) for this model, got {bad[:5]}",
                param="tokens",
                code="invalid_value",
            )
        return {"prompt": self.model.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    def _render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The prompt's token ids (on `self.prompts`' thread when long)."""
        extra = {} if tools is None else {"tools": tools}
        try:
            rendered = self.model.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, **extra
            )
        except Exception as exc:  # a template error names the message it disliked
            raise APIError(
                400, f"messages: cannot apply the chat template: {exc}", "messages", "invalid_value"
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
        calling: ToolCalling | None = None,
    ) -> PreparedRequest:
        limit = self.model.max_model_len
        if not prompt:
            raise APIError(
                400, "prompt: the prompt is empty after tokenization", "prompt", "invalid_value"
            )
        if max(prompt) >= self.model.vocab_size:
            raise APIError(
                400, f"prompt: token ids must be below the vocabulary size {self.model.vocab_size}",
                "prompt", "invalid_value",
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
            params=_sampling_params(body, max_tokens or room, logprobs, _grammar(body, calling)),
            stop_strings=tuple(body.stop_strings),
            include_stop_str_in_output=body.include_stop_str_in_output,
            images=images,
        )


def _grammar(body: SamplingFields, calling: ToolCalling | None) -> GrammarSpec | None:
    """The request's grammar: its structured-output fields' or its tool calls'."""
    try:
        found = grammar_of(body)
    except StructuredError as exc:
        raise APIError(400, str(exc), exc.param, "invalid_value") from exc
    if calling is not None:
        if found is not None:
            raise APIError(
                400,
                f"{found[0]}: cannot constrain a tool call's output, whose schema the tool "
                "gives; send one of the two",
                found[0],
                "invalid_value",
            )
        found = ("tool_choice", calling.grammar)
    if found is not None and body.ignore_eos:
        raise APIError(
            400,
            f"ignore_eos: cannot be combined with {found[0]}: the output ends where its "
            "grammar does; leave ignore_eos out",
            "ignore_eos",
            "invalid_value",
        )
    return None if found is None else found[1]


def _tool_rendering(
    calling: ToolCalling,
    writer: fmt.ChunkWriter,
    whole: Callable[[Delta], dict[str, Any]],
    n: int,
) -> tuple[Callable[[Delta], str], Callable[[Delta], dict[str, Any]]]:
    """Chunk and body renderers that answer with tool calls: a streamed
    choice sends its calls whole in its last chunk (the text is JSON until
    it ends), and an output cut before its calls end is returned as content."""
    texts = [""] * n

    def tool_whole(delta: Delta) -> dict[str, Any]:
        body = whole(delta)
        message = calling.message(delta.text)
        if message is not None:
            choice = body["choices"][0]
            choice["message"] = message
            choice["finish_reason"] = calling.finish_reason(delta.finish_reason)
        return body

    def tool_chunk(delta: Delta) -> str:
        texts[delta.index] += delta.text
        if delta.finish_reason is None:
            return ""
        message = calling.message(texts[delta.index])
        if message is None:
            content = {"content": texts[delta.index]}
            return writer.line(fmt.chat_choice(content, delta.finish_reason, None, delta.index))
        calls = [{"index": i} | call for i, call in enumerate(message["tool_calls"])]
        finish = calling.finish_reason(delta.finish_reason)
        return writer.line(fmt.chat_choice({"tool_calls": calls}, finish, None, delta.index))

    return tool_chunk, tool_whole


def _sampling_params(
    body: SamplingFields, max_tokens: int, logprobs: int | None, grammar: GrammarSpec | None
) -> Any:
    try:
        return _build_sampling_params(body, max_tokens, logprobs, grammar)
    except ValueError as exc:  # SamplingParams names the field it rejects
        raise APIError(400, str(exc), code="invalid_value") from exc


def _build_sampling_params(
    body: SamplingFields, max_tokens: int, logprobs: int | None, grammar: GrammarSpec | None
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
        n=body.n,
        grammar=grammar,
    )
