"""When a request stops.

`StopChecker` decides after every new token whether the request is finished
(EOS, a stop token, a stop string, or `max_tokens`) and where the text ends.

Typical use per request, once per sampled token, with the tokenizer's
streaming decoder (`models.tokenizer.Tokenizer.detokenizer`):

    new_text = detok.push(token_id)
    decision = checker.check(token_id, new_text)
    if decision.finished and decision.truncate_to is not None:
        text = text[: decision.truncate_to]  # the caller's text, new_text included

The checker keeps only the text a stop string could still complete (the
last `max_stop_len - 1` characters), so a token costs the same at the end of
a long output as at its start.

A streaming caller that must never show a stop string should release text
only up to `checker.releasable(len(text))` until the request finishes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.sampling import SamplingParams

STOP = "stop"
LENGTH = "length"


@dataclass(frozen=True)
class StopDecision:
    """Whether the request is finished after its newest token.

    `reason` is "stop" or "length" when finished, else None. `truncate_to` is
    the output text length to keep when a stop string matched (the match is
    cut off unless `include_stop_str_in_output`); None keeps the text as is.
    `stop_reason` is the matched stop token id or stop string, None for EOS
    and length.
    """

    finished: bool
    reason: str | None = None
    truncate_to: int | None = None
    stop_reason: int | str | None = None


_RUNNING = StopDecision(finished=False)


class StopChecker:
    """Stop conditions of one request; call `check` once per generated token."""

    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int]) -> None:
        self.params = params
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.max_stop_len = max((len(s) for s in params.stop), default=0)
        self.num_tokens = 0
        self._text_len = 0  # characters of output text so far
        self._tail = ""  # their last max_stop_len - 1 characters

    def check(
        self, new_token_id: int, new_text: str = "", num_output_tokens: int | None = None
    ) -> StopDecision:
        """Decide after `new_token_id`, whose text (the detokenizer's delta) is
        `new_text`; stop strings need it, the other conditions do not.

        Only a stop string ending in the new text can be new, so each call
        scans O(new text + longest stop string). The first stop string to
        end wins. `num_output_tokens` (this token included) is for callers
        whose request got tokens elsewhere (the context worker's first
        token); by default the checker counts its own calls.
        """
        self.num_tokens = self.num_tokens + 1 if num_output_tokens is None else num_output_tokens
        if new_token_id in self.eos_token_ids:
            return StopDecision(finished=True, reason=STOP)
        if new_token_id in self.stop_token_ids:
            return StopDecision(finished=True, reason=STOP, stop_reason=new_token_id)
        matched = self._find_stop_string(new_text)
        if matched is not None:
            return matched
        if self.num_tokens >= self.params.max_tokens:
            return StopDecision(finished=True, reason=LENGTH)
        return _RUNNING

    def releasable(self, text_len: int) -> int:
        """How much of a running request's text can be shown without ever showing a stop string.

        The last `max_stop_len - 1` characters may be the start of a stop
        string that the next tokens complete, so they wait.
        """
        return max(0, text_len - max(0, self.max_stop_len - 1))

    def _find_stop_string(self, new_text: str) -> StopDecision | None:
        if not self.params.stop:
            return None
        # A match within the old text was already found (or was not there): the
        # tail is shorter than the longest stop string, so any match in the
        # window ends in the new text. The window starts at `offset` of the text.
        window = self._tail + new_text
        offset = self._text_len - len(self._tail)
        self._text_len += len(new_text)
        self._tail = window[-(self.max_stop_len - 1) :] if self.max_stop_len > 1 else ""
        match = first_stop(window, self.params.stop)
        if match is None:
            return None
        start, end, stop = match
        keep = offset + (end if self.params.include_stop_str_in_output else start)
        return StopDecision(finished=True, reason=STOP, truncate_to=keep, stop_reason=stop)


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, int, str] | None:
    """(start, end, stop) of the stop string in `text` that ends first (on a
    tie, the first listed), or None: where a request stops, on the workers
    and in the server's filter alike."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        at = text.find(stop)
        if at != -1 and (best is None or at + len(stop) < best[1]):
            best = (at, at + len(stop), stop)
    return best
