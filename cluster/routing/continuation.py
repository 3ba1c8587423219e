"""What a disaggregated request runs next, given the tokens its caller already has.

The router sends a request's first token on as soon as the context worker
returns it, before the cache moves. A pull that fails after that cannot
start the request over, since the caller has a token: the next attempt
prefills the prompt followed by every token sent so far and produces only
the rest.

    prompt p, max_tokens m        -> first token t1 sent, pull fails
    prompt p + [t1], max_tokens m-1 -> t2 ... (the caller sees t1 t2 ...)

The same holds for a request the generation worker hands back after a
preemption (it cannot recompute a prompt whose images it never had): every
token streamed so far moves into the next attempt's prompt.

Greedy decoding continues exactly as the lost attempt would have. Sampling
continues from the sent text with fresh draws, and the moved tokens count as
prompt for the penalties (repetition still sees them; presence and frequency
penalties, which look at the output only, no longer do).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from engine.messages import TokenEvent


class Continuation:
    """The prompt and sampling parameters of a request's next attempt."""

    def __init__(self, prompt: list[int], params: Any) -> None:
        self.original_prompt = prompt
        self.original_params = params  # an `engine.sampling.SamplingParams`
        self.sent: list[int] = []

    def advance(self, token_ids: Sequence[int]) -> None:
        """`token_ids` reached the caller: the next attempt starts after them.
        Cheap, so the router can call it for every event it streams."""
        self.sent.extend(token_ids)

    @property
    def resumable(self) -> bool:
        """Whether a next attempt can continue what the caller has: not for
        n samples (`engine.samples`) once any token was sent, since one
        prefill of the prompt and one sample's tokens cannot go on with all."""
        return not self.sent or getattr(self.original_params, "n", 1) == 1

    @property
    def prompt(self) -> list[int]:
        return [*self.original_prompt, *self.sent] if self.sent else self.original_prompt

    @property
    def params(self) -> Any:
        if not self.sent:
            return self.original_params
        max_tokens = self.original_params.max_tokens - len(self.sent)
        return dataclasses.replace(self.original_params, max_tokens=max_tokens)

    def event(self, event: TokenEvent) -> TokenEvent:
        """An event of the current attempt as the caller's request sees it."""
        if event.num_prompt_tokens == len(self.original_prompt):
            return event
        return dataclasses.replace(event, num_prompt_tokens=len(self.original_prompt))
