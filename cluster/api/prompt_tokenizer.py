"""Prompt tokenization off the HTTP server's event loop.

Every stream the server sends shares one event loop, so a prompt tokenized
on it stalls them all: a long prompt takes tens of milliseconds to tokenize
(docs/performance.md, "HTTP server"), with the GIL held throughout. `PromptTokenizer`
runs a long prompt on a thread of its own, where `Tokenizer.encode` (the
`tokenizers` batch call) releases the GIL while Rust tokenizes, so the loop
keeps sending tokens meanwhile. A chat template renders in Python with the
GIL held; on that thread the loop still runs between the interpreter's
switches (every 5 ms) instead of waiting for the whole render.

A short prompt is tokenized inline: below `INLINE_MAX_CHARS` the encode
costs little more than the hand-off to the thread and back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

INLINE_MAX_CHARS = 1024

T = TypeVar("T")


class PromptTokenizer:
    """Runs prompt tokenization for the server (`tokenizer` is a `models.tokenizer.Tokenizer`)."""

    def __init__(self, tokenizer: Any, inline_max_chars: int = INLINE_MAX_CHARS) -> None:
        self.tokenizer = tokenizer
        self.inline_max_chars = inline_max_chars
        # One thread: prompts queue behind each other rather than take a core
        # each from the engines on the same machine.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="prompt-tokenizer")

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.run(len(text), self.tokenizer.encode, text, add_special_tokens)

    async def run(self, chars: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, inline for a prompt of fewer than `inline_max_chars`
        characters, else on the tokenizer thread; its exceptions propagate."""
        if chars < self.inline_max_chars:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def close(self) -> None:
        """Stop the thread once the prompts handed to it are done."""
        self._thread.shutdown(wait=False, cancel_futures=True)
