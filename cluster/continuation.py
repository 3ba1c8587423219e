"""What a disaggregated request runs next, given the tokens its caller already has.

The router sends a request's first token on as soon as the context worker
returns it, before the cache moves. A pull that fails after that cannot
start the request over, since the caller has a token: the next attempt
prefills the prompt followed by every token sent so far and produces only
the rest.

    prompt p, max_tokens m        -> first token t1 sent, pull fails
    prompt p + [t1], max_tokens m-1 -> t2 ... (the caller sees t1 t2 ...)

Greedy decoding continues exactly as the lost attempt would have. Sampling
continues from the sent text with fresh draws, and the moved tokens count as
prompt for the penalties (repetition still sees them; presence and frequency
penalties, which look at the output only, no longer do).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.messages import TokenEvent


class Continuation:
    """The prompt and sampling parameters of a request's next attempt."""

    def __init__(self, prompt: list[int], params: Any) -> None:
        self.original_prompt = prompt
        self.prompt = prompt
        self.params = params  # an `engine.sampling.SamplingParams`
        self.sent: list[int] = []

    def advance(self, token_id: int) -> None:
        """`token_id` reached the caller: the next attempt starts after it."""
        self.sent.append(token_id)
        self.prompt = [*self.original_prompt, *self.sent]
        self.params = dataclasses.replace(self.params, max_tokens=self.params.max_tokens - 1)

    def event(self, event: TokenEvent) -> TokenEvent:
        """An event of the current attempt as the caller's request sees it."""
        if not self.sent:
            return event
        return dataclasses.replace(event, num_prompt_tokens=len(self.original_prompt))
