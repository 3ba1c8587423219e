"""The tokens a request has seen, as the penalties read them, kept from step to step.

Repetition, presence and frequency penalties (`engine.sampling`) depend on
which tokens a request's prompt and output hold and on how often each
occurs in the output, not on their order. So a request with penalties keeps
one `TokenHistory`: its distinct token ids and, beside each, its count in
the output, updated with the step's new tokens only.

    prompt [5, 9, 5]  output [9, 7, 9]
    ids    [5, 9, 7]          (prompt's distinct ids first, then new ones as they come)
    counts [0, 2, 1]          (occurrences in the output)

Rebuilding that from the token lists every step cost time that grows with
the context, at long contexts as long as a whole decode step of a small
model (docs/performance.md, "Engine"). Ids outside
`[0, vocab)` have no logit to penalize and are left out.

Pure Python over ints and numpy arrays: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

_INITIAL_CAPACITY = 64


class TokenHistory:
    """Distinct ids of a prompt plus output, with output counts (see the module docstring)."""

    def __init__(self, prompt: Sequence[int], vocab: int) -> None:
        self.vocab = vocab
        self.prompt_len = len(prompt)
        ids = np.asarray(prompt, dtype=np.int64)
        ids = np.unique(ids[(ids >= 0) & (ids < vocab)])
        self._size = len(ids)
        capacity = max(_INITIAL_CAPACITY, 2 * self._size)
        self._ids = np.empty(capacity, dtype=np.int64)
        self._ids[: self._size] = ids
        self._counts = np.zeros(capacity, dtype=np.float32)
        self._index = dict(zip(ids.tolist(), range(self._size), strict=True))
        self.output_len = 0  # output tokens counted so far

    @property
    def ids(self) -> npt.NDArray[np.int64]:
        """The distinct ids, each once (a view; valid until the next `extend`)."""
        return self._ids[: self._size]

    @property
    def counts(self) -> npt.NDArray[np.float32]:
        """Output occurrences of `ids[i]` (a view; valid until the next `extend`)."""
        return self._counts[: self._size]

    def follows(self, prompt: Sequence[int], output: Sequence[int]) -> bool:
        """Whether this history can catch up with a request of this prompt
        and output: same prompt length, and no output token it counted gone."""
        return len(prompt) == self.prompt_len and len(output) >= self.output_len

    def sync(self, output: Sequence[int]) -> None:
        """Count the output tokens added since the last call."""
        for token in output[self.output_len :]:
            self._add(token)
        self.output_len = len(output)

    def _add(self, token: int) -> None:
        if not 0 <= token < self.vocab:
            return
        i = self._index.get(token)
        if i is None:
            i = self._size
            if i == len(self._ids):
                self._ids = np.concatenate([self._ids, np.empty_like(self._ids)])
                self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
            self._ids[i] = token
            self._index[token] = i
            self._size += 1
        self._counts[i] += 1.0


def history_for(
    cache: dict[str, TokenHistory],
    request_id: str,
    prompt: Sequence[int],
    output: Sequence[int],
    vocab: int,
) -> TokenHistory:
    """`cache[request_id]` brought up to date with `output`, created (or
    rebuilt, when it no longer follows the request) as needed."""
    history = cache.get(request_id)
    if history is None or history.vocab != vocab or not history.follows(prompt, output):
        history = cache[request_id] = TokenHistory(prompt, vocab)
    history.sync(output)
    return history
