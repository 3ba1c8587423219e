"""Prompt tokenization off the event loop: long prompts on the tokenizer
thread while the loop keeps running, short ones inline, same ids either way."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cluster.prompt_tokenizer import INLINE_MAX_CHARS, PromptTokenizer
from models.tokenizer import load_tokenizer

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
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("tokenizer")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator([" ".join(WORDS)], trainer=trainer)
    backend.save(str(folder / "tokenizer.json"))
    return load_tokenizer(folder)


def _text(chars: int) -> str:
    words = (WORDS[i % len(WORDS)] for i in range(chars))
    return " ".join(words)[:chars]


async def _encode_counting_loop_turns(prompts: PromptTokenizer, text: str) -> tuple[list[int], int]:
    """The ids, and how many times another coroutine ran while they were computed."""
    task = asyncio.ensure_future(prompts.encode(text))
    turns = 0
    while not task.done():
        turns += 1
        await asyncio.sleep(0)
    return task.result(), turns


def test_a_long_prompt_is_tokenized_while_the_loop_keeps_running(tokenizer: Any) -> None:
    text = _text(400_000)
    prompts = PromptTokenizer(tokenizer)
    try:
        ids, turns = asyncio.run(_encode_counting_loop_turns(prompts, text))
    finally:
        prompts.close()
    assert ids == list(tokenizer.backend.encode(text).ids)
    # Inline, the encode would finish within the loop's first turn.
    assert turns > 1


def test_a_short_prompt_is_tokenized_inline(tokenizer: Any) -> None:
    text = _text(INLINE_MAX_CHARS - 1)
    prompts = PromptTokenizer(tokenizer)
    try:
        ids, turns = asyncio.run(_encode_counting_loop_turns(prompts, text))
    finally:
        prompts.close()
    assert ids == list(tokenizer.backend.encode(text).ids)
    assert turns == 1


def test_work_on_the_thread_raises_where_it_was_awaited(tokenizer: Any) -> None:
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
