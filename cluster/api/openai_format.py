"""OpenAI response bodies: completions and chat completions, whole and chunked.

Pure functions from `Delta`s to the JSON shapes OpenAI's API returns, so the
server's routes only decide *when* to send what. Streaming chunks follow the
official format: `text_completion` / `chat.completion.chunk` objects, a
final chunk carrying `finish_reason`, and (with
`stream_options.include_usage`) one more chunk with empty `choices` and the
usage, before `data: [DONE]`.
"""

from __future__ import annotations

import codecs
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from cluster.api.completion import Delta


class TokenText(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...


def token_text(token: bytes) -> str:
    """A token as logprobs show it: its text, or `bytes:\\xNN...` when its
    bytes are not whole UTF-8 characters (part of a multi-byte character)."""
    try:
        return token.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in token)


@dataclass(frozen=True)
class ResponseMeta:
    """What every body of one response repeats."""

    id: str
    created: int
    model: str


def usage(delta: Delta) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": delta.num_prompt_tokens,
        "completion_tokens": delta.num_output_tokens,
        "total_tokens": delta.num_prompt_tokens + delta.num_output_tokens,
    }
    if delta.num_cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": delta.num_cached_tokens}
    return body


def sse(body: dict[str, Any]) -> str:
    return f"data: {_dumps(body)}\n\n"


# Every body and chunk goes through this one encoder: `json.dumps` with any
# option set builds a new `JSONEncoder` per call.
_dumps = json.JSONEncoder(separators=(",", ":")).encode


class ChunkWriter:
    """SSE lines of one stream's chunks. The fields every chunk repeats (id,
    object, created, model) are serialized once per stream, and what follows
    a token's text once per finish reason; each chunk serializes only its
    own text (or choice). The line is what `sse` makes of the whole chunk
    object."""

    def __init__(self, meta: ResponseMeta, obj: str) -> None:
        head = _dumps({"id": meta.id, "object": obj, "created": meta.created, "model": meta.model})
        self._prefix = f'data: {head[:-1]},"choices":['

    def line(self, choice: dict[str, Any]) -> str:
        return f"{self._prefix}{_dumps(choice)}]}}\n\n"

    def text_line(self, text: str, finish: str | None, index: int = 0) -> str:
        """`line(completion_choice(text, finish, None, index))`, built without
        a dict: the line of almost every streamed token."""
        return f'{self._prefix}{{"index":{index},"text":{_dumps(text)}{_choice_tail(finish)}'

    def content_line(self, text: str, finish: str | None, index: int = 0) -> str:
        """`line(chat_choice({"content": text} if text else {}, finish, None,
        index))`, built without a dict."""
        delta = f'{{"content":{_dumps(text)}}}' if text else "{}"
        return f'{self._prefix}{{"index":{index},"delta":{delta}{_choice_tail(finish)}'


@functools.cache
def _choice_tail(finish: str | None) -> str:
    """What closes a streamed choice without logprobs, and its chunk's line."""
    return f',"logprobs":null,"finish_reason":{_dumps(finish)}}}]}}\n\n'


SSE_DONE = "data: [DONE]\n\n"


def merge(deltas: Sequence[Delta]) -> Delta:
    """All deltas of a finished request as one."""
    last = deltas[-1]
    logprobs = [lp for d in deltas for lp in (d.logprobs or [])]
    tops = [t for d in deltas for t in (d.top_logprobs or [])]
    return Delta(
        text="".join(d.text for d in deltas),
        token_ids=[t for d in deltas for t in d.token_ids],
        logprobs=logprobs if any(d.logprobs for d in deltas) else None,
        top_logprobs=tops if any(d.top_logprobs for d in deltas) else None,
        finish_reason=last.finish_reason,
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        num_cached_tokens=last.num_cached_tokens,
        index=last.index,
    )


def merge_choices(deltas: Sequence[Delta]) -> list[Delta]:
    """A finished request's deltas merged per choice, in index order."""
    by_index: dict[int, list[Delta]] = {}
    for delta in deltas:
        by_index.setdefault(delta.index, []).append(delta)
    return [merge(by_index[index]) for index in sorted(by_index)]


def summed(choices: Sequence[Delta]) -> Delta:
    """A delta whose usage is that of the choices together: their prompt
    once (one prefill), their output tokens summed."""
    last = choices[-1]
    return replace(last, num_output_tokens=sum(c.num_output_tokens for c in choices))


# --- /v1/completions -------------------------------------------------------


def token_name(token_id: int, tokenizer: TokenText, as_id: bool) -> str:
    """How logprobs name a token: its text, or `token_id:N` when the request
    asked for ids (`return_tokens_as_token_ids`, as vLLM names them)."""
    return f"token_id:{token_id}" if as_id else token_text(tokenizer.token_bytes(token_id))


def completion_logprobs(
    delta: Delta, tokenizer: TokenText, num_top: int, text_offset: int, as_ids: bool = False
) -> dict[str, Any] | None:
    """The legacy completions `logprobs` object for the tokens of `delta`."""
    if delta.logprobs is None:
        return None
    raw = [tokenizer.token_bytes(t) for t in delta.token_ids]
    # Offsets count characters of the text; a character split over tokens
    # counts where it completes.
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, at = [], text_offset
    for token in raw:
        offsets.append(at)
        at += len(text.decode(token))
    tokens = [token_name(t, tokenizer, as_ids) for t in delta.token_ids]
    tops = delta.top_logprobs or [[] for _ in tokens]
    return {
        "tokens": tokens,
        "token_logprobs": list(delta.logprobs),
        "top_logprobs": [
            {token_name(t, tokenizer, as_ids): lp for t, lp in top[:num_top]} for top in tops
        ],
        "text_offset": offsets,
    }


def completion_choice(
    text: str, finish: str | None, logprobs: Any, index: int = 0
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def completion_chunk(
    meta: ResponseMeta, text: str, finish: str | None, logprobs: Any
) -> dict[str, Any]:
    return {
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [completion_choice(text, finish, logprobs)],
    }


def completion_body(meta: ResponseMeta, whole: Delta, logprobs: Any) -> dict[str, Any]:
    body = completion_chunk(meta, whole.text, whole.finish_reason, logprobs)
    body["usage"] = usage(whole)
    return body


def usage_chunk(meta: ResponseMeta, obj: str, whole: Delta) -> dict[str, Any]:
    return {
        "id": meta.id,
        "object": obj,
        "created": meta.created,
        "model": meta.model,
        "choices": [],
        "usage": usage(whole),
    }


# --- /v1/chat/completions --------------------------------------------------


def chat_logprobs(
    delta: Delta, tokenizer: TokenText, num_top: int, as_ids: bool = False
) -> dict[str, Any] | None:
    if delta.logprobs is None:
        return None
    tops = delta.top_logprobs or [[] for _ in delta.token_ids]
    content = []
    for token_id, lp, top in zip(delta.token_ids, delta.logprobs, tops, strict=False):
        raw = tokenizer.token_bytes(token_id)
        content.append(
            {
                "token": token_name(token_id, tokenizer, as_ids),
                "logprob": lp,
                "bytes": list(raw),
                "top_logprobs": [
                    {"token": token_name(i, tokenizer, as_ids), "logprob": v, "bytes": list(b)}
                    for i, v in top[:num_top]
                    for b in (tokenizer.token_bytes(i),)
                ],
            }
        )
    return {"content": content}


def chat_choice(
    delta: dict[str, Any], finish: str | None, logprobs: Any = None, index: int = 0
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def chat_chunk(
    meta: ResponseMeta, delta: dict[str, Any], finish: str | None, logprobs: Any = None
) -> dict[str, Any]:
    return {
        "id": meta.id,
        "object": "chat.completion.chunk",
        "created": meta.created,
        "model": meta.model,
        "choices": [chat_choice(delta, finish, logprobs)],
    }


def chat_body(meta: ResponseMeta, whole: Delta, logprobs: Any) -> dict[str, Any]:
    return {
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": whole.text},
                "logprobs": logprobs,
                "finish_reason": whole.finish_reason,
            }
        ],
        "usage": usage(whole),
    }
