"""The resolved speculative decoding settings a worker runs with."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "mtp")
# Methods whose drafter is a part of the model that also runs on context
# workers (the first drafts travel with the first token).
MODEL_METHODS = ("mtp",)
# The most drafts one step verifies per request: the verify rows of a
# request grow the step's logits and, on a hybrid model, its Mamba scratch
# slots (one per draft position and batch row).
MAX_SPECULATIVE_TOKENS = 16


class SpeculativeConfigError(ValueError):
    """A speculative decoding setting no worker can run with."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """How a worker drafts and how many tokens it verifies a step.

    method: "ngram" (prompt lookup over the request's own tokens) or "mtp"
        (the checkpoint's multi-token-prediction layers, run after every
        forward on the target's hidden states; `engine.speculation.mtp`).
    num_speculative_tokens: drafts verified per request and step (k).
    prompt_lookup_min / prompt_lookup_max: the n-gram sizes tried, longest
        first: the sequence's last n tokens are looked up in its earlier
        tokens, and the tokens after the latest match are the drafts.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    @property
    def uses_model(self) -> bool:
        """Drafts come from the model's own layers (which then run on every
        role, and whose attention KV lives in the paged cache)."""
        return self.method in MODEL_METHODS

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpeculativeConfigError(
                f"speculative method must be one of {METHODS}, got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(
                f"num_speculative_tokens must be an int in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
            raise SpeculativeConfigError(
                "prompt_lookup_min and prompt_lookup_max must be ints with "
                f"1 <= prompt_lookup_min <= prompt_lookup_max, got {low!r} and {high!r}"
            )
