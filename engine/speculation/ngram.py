"""Prompt lookup: drafts from the sequence's own earlier tokens.

The sequence's last n tokens are looked for earlier in it, longest n first
(`prompt_lookup_max` down to `prompt_lookup_min`); the tokens that followed
the latest earlier match are the drafts. Answers that quote their prompt
(edit, extract, repeat a passage) hit often, free text rarely, and a miss
costs only the lookup.

    tokens:  ... the cat sat on the mat . the cat sat [?]
    n = 3:   "the cat sat" matched earlier -> drafts "on the mat"

The tokens are kept in a growing numpy array per request, so a lookup is a
few vectorized comparisons over the sequence, not a Python loop.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view


class TokenBuffer:
    """A request's token ids, appended to as it decodes."""

    def __init__(self, token_ids: list[int]) -> None:
        self._data = np.asarray(token_ids, dtype=np.int64)
        self._size = len(token_ids)
        self._data = np.resize(self._data, max(16, 2 * self._size))

    def __len__(self) -> int:
        return self._size

    def extend(self, token_ids: list[int]) -> None:
        need = self._size + len(token_ids)
        if need > len(self._data):
            self._data = np.resize(self._data, 2 * need)
        self._data[self._size : need] = token_ids
        self._size = need

    def view(self) -> npt.NDArray[np.int64]:
        return self._data[: self._size]


def propose(tokens: npt.NDArray[np.int64], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_drafts` tokens that followed the latest earlier occurrence
    of the sequence's last n tokens, for the longest n in [min_n, max_n]
    that occurs; [] when none does."""
    length = len(tokens)
    if num_drafts <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Windows that start early enough to have a token after them, so the
        # suffix itself (the last window) is never its own match.
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + num_drafts].tolist()
    return []
