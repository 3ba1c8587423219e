"""OpenAI-compatible request bodies, validated at the HTTP edge.

Bodies are strict (`extra="forbid"`, `strict=True`): a misspelt parameter or
a value of the wrong JSON type (`"stream": "yes"`, `"temperature": "0.5"`) is
a 400 that names it, never silently ignored or coerced. Besides OpenAI's own fields, the vLLM-style
sampling extensions `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`stop_token_ids` and `include_stop_str_in_output` are accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from cluster.api.structured import StructuredFields
from cluster.api.tools import ToolCall, ToolChoice, ToolDefinition
from engine.samples import MAX_SAMPLES
from engine.sampling import MAX_SEED, MAX_TOP_K, MIN_SEED

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
# Prompts one /v1/completions request may list (each runs as its own request).
MAX_PROMPTS = 64


def _unicode_text(value: str) -> str:
    """`value`, unless it holds an unpaired UTF-16 surrogate: JSON lets a
    string carry one as an escape ("\\ud800"), and it decodes to a code
    point that is not text, which no tokenizer encodes. Applied to every
    string that reaches the tokenizer or the stop-string matcher."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"character {exc.start} is an unpaired surrogate escape; send valid Unicode text"
        ) from None
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class SamplingFields(StructuredFields):
    """Fields shared by completions and chat completions (structured output's
    among them: `cluster.api.structured`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=MAX_TOP_K)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=MIN_SEED, le=MAX_SEED)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # vLLM's extension: logprobs name each token "token_id:N" instead of its text.
    return_tokens_as_token_ids: bool = False
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _choices(cls, value: int) -> int:
        if not 1 <= value <= MAX_SAMPLES:
            raise ValueError(
                f"n must be between 1 and {MAX_SAMPLES} (choices sampled from one prefill), "
                f"got {value}; send several requests for more"
            )
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        for stop in stops:
            _unicode_text(stop)
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, value: list[int]) -> list[int]:
        if value and min(value) < 0:
            raise ValueError("stop token ids must be non-negative")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# OpenAI's /v1/completions has no image input; its chat endpoint has.
_NO_COMPLETION_IMAGES = (
    "/v1/completions takes text only (strings or lists of token ids); "
    "send images as image_url content parts to /v1/chat/completions"
)


Prompt = str | list[int]


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`: a prompt as text or token ids, or a list of
    such prompts (answered as one choice each, `index` = its position)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's offline field for images; named here only to refuse it clearly.
    multi_modal_data: Any = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shapes(cls, value: Any) -> Any:
        # Element types in one C-level pass: a prompt runs to thousands of ids.
        types = set(map(type, value)) if isinstance(value, list) else set()
        if any(issubclass(t, dict) for t in types):
            raise ValueError(_NO_COMPLETION_IMAGES)
        if isinstance(value, str) or (isinstance(value, list) and types <= {int}):
            return value
        if isinstance(value, list) and (types == {str} or types == {list}):
            if len(value) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}")
            return value
        raise ValueError(
            "prompt must be a string, a list of token ids, or a list of either "
            "(all strings or all token-id lists)"
        )

    @field_validator("prompt")
    @classmethod
    def _non_empty_prompt(
        cls, value: str | list[int] | list[str] | list[list[int]]
    ) -> str | list[int] | list[str] | list[list[int]]:
        if len(value) == 0:
            raise ValueError("prompt must not be empty")
        one = isinstance(value, str) or isinstance(value[0], int)
        prompts: list[Prompt] = [value] if one else list(value)  # type: ignore[arg-type, list-item]
        for i, prompt in enumerate(prompts):
            where = "" if one else f"prompt {i}: "
            if len(prompt) == 0:
                raise ValueError(f"{where}prompt must not be empty")
            if isinstance(prompt, str):
                _unicode_text(prompt)
            elif min(prompt) < 0:
                raise ValueError(f"{where}prompt token ids must be non-negative")
        return value

    @model_validator(mode="after")
    def _lists_answer_whole(self) -> CompletionRequest:
        if self.stream and self.prompt_list() is not None:
            raise ValueError(
                "a list of prompts is answered whole: send stream: false, "
                "or stream one request per prompt"
            )
        return self

    def prompt_list(self) -> list[Prompt] | None:
        """The prompts of a listed prompt (None for a single prompt)."""
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return None
        return list(prompt)  # type: ignore[arg-type]

    @field_validator("multi_modal_data")
    @classmethod
    def _no_images(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(_NO_COMPLETION_IMAGES)
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported; send the prompt without echo")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value != n:
            raise ValueError(
                f"best_of must equal n ({n}) when given: every sample is returned, "
                "none is ranked; send n alone"
            )
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix (insertion) is not supported by decoder-only models")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] = "auto"  # accepted; images keep their own size


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["image_url"]
    image_url: ImageURL


# OpenAI's other content parts, refused by name rather than as a schema mismatch.
_UNSUPPORTED_PARTS = ("input_audio", "audio_url", "video_url", "file", "refusal")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    # Earlier turns of a tool-calling conversation (`cluster.api.tools`).
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _known_part_types(cls, value: Any) -> Any:
        for part in value if isinstance(value, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _UNSUPPORTED_PARTS:
                raise ValueError(
                    f"content parts of type {kind!r} are not supported; "
                    "this server takes 'text' and 'image_url' parts"
                )
        return value

    @field_validator("content")
    @classmethod
    def _text_content(
        cls, value: str | list[TextPart | ImagePart] | None
    ) -> str | list[TextPart | ImagePart] | None:
        for part in value if isinstance(value, list) else [value]:
            if isinstance(part, str | TextPart):
                _unicode_text(part if isinstance(part, str) else part.text)
        return value

    @field_validator("name")
    @classmethod
    def _text_name(cls, value: str | None) -> str | None:
        return value if value is None else _unicode_text(value)

    def parts(self) -> list[TextPart | ImagePart]:
        if self.content is None:
            return []
        if isinstance(self.content, str):
            return [TextPart(type="text", text=self.content)]
        return list(self.content)


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`: messages rendered with the checkpoint's template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def image_parts(self) -> list[tuple[str, ImagePart]]:
        """`(param, part)` of every image part in message order, `param` naming
        it as `messages[i].content[j]`."""
        return [
            (f"messages[{i}].content[{j}]", part)
            for i, message in enumerate(self.messages)
            for j, part in enumerate(message.parts())
            if isinstance(part, ImagePart)
        ]

    def template_messages(self, image_texts: Sequence[str] = ()) -> list[dict[str, Any]]:
        """Messages as the plain dicts a Hugging Face chat template expects; the
        k-th image part becomes `image_texts[k]` (its placeholder tokens)."""
        texts = iter(image_texts)
        rendered = []
        for m in self.messages:
            message: dict[str, Any] = {
                "role": m.role,
                "content": "".join(
                    part.text if isinstance(part, TextPart) else next(texts) for part in m.parts()
                ),
            }
            if m.tool_calls is not None:
                message["tool_calls"] = [call.model_dump() for call in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            rendered.append(message)
        return rendered


class TokenizeRequest(BaseModel):
    """vLLM's `POST /tokenize`: a prompt, or chat messages rendered with the
    checkpoint's template (text parts only)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send a prompt or messages, one of the two")
        for i, message in enumerate(self.messages or ()):
            if any(isinstance(part, ImagePart) for part in message.parts()):
                raise ValueError(f"messages[{i}]: /tokenize takes text parts only")
        if self.prompt is not None:
            _unicode_text(self.prompt)
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's `POST /detokenize`: token ids back to text."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]
