"""Prompt tokenization off the event loop: long prompts on the tokenizer
thread while the loop keeps running, short ones inline, same ids either way."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cluster.api.prompt_tokenizer import INLINE_MAX_CHARS, PromptTokenizer
from models.embedded.tokenizer import train_tokenizer
from models.tokenizer import Tokenizer

WORDS = [
    "serving",
    "paged",
    "attention",
    "on",
    "the",
    "decode",
    "side",
    "of",
    "a",
    "disaggregated",
    "cluster",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(train_tokenizer(512), {}, (2,), None)


def _text(chars: int) -> str:
    words = (WORDS[i % len(WORDS)] for i in range(chars))
    return " ".join(words)[:chars]


def _encode_counting_loop_turns(tokenizer: Tokenizer, text: str) -> tuple[list[int], int]:
    """The ids, and how many times another coroutine ran while they were computed."""

    async def encode() -> tuple[list[int], int]:
        task = asyncio.ensure_future(prompts.encode(text))
        turns = 0
        while not task.done():
            turns += 1
            await asyncio.sleep(0)
        return task.result(), turns

    prompts = PromptTokenizer(tokenizer)
    try:
        return asyncio.run(encode())
    finally:
        prompts.close()


def test_a_long_prompt_is_tokenized_while_the_loop_keeps_running(tokenizer: Tokenizer) -> None:
    text = _text(400_000)
    ids, turns = _encode_counting_loop_turns(tokenizer, text)
    assert ids == list(tokenizer.backend.encode(text).ids)
    # Inline, the encode would finish within the loop's first turn.
    assert turns > 1


def test_a_short_prompt_is_tokenized_inline(tokenizer: Tokenizer) -> None:
    text = _text(INLINE_MAX_CHARS - 1)
    ids, turns = _encode_counting_loop_turns(tokenizer, text)
    assert ids == list(tokenizer.backend.encode(text).ids)
    assert turns == 1


def test_work_on_the_thread_raises_where_it_was_awaited(tokenizer: Tokenizer) -> None:
    def refuse(_: str) -> list[int]:
        assert threading.current_thread() is not threading.main_thread()
        raise ValueError("cannot apply the chat template")

    async def render() -> list[int]:
        return await prompts.run(INLINE_MAX_CHARS, refuse, "messages")

    prompts = PromptTokenizer(tokenizer)
    try:
        with pytest.raises(ValueError, match="chat template"):
            asyncio.run(render())
    finally:
        prompts.close()
