"""Stop strings over a stream of text deltas.

Workers stop a sequence when its text contains a stop string, but the text
the client sees is cut here: nothing from the stop string on (unless
`include_stop_str_in_output`) may reach it. So text that could be the start
of a stop string is held back until the next deltas rule the stop string in
or out:

    stop = "END"     deltas "ab", "cE", "N", "D!"  ->  "ab", "c", "", "" (stopped)
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringFilter:
    def __init__(self, stop_strings: Sequence[str] = (), include_stop: bool = False) -> None:
        self._stops = [s for s in stop_strings if s]
        self._include_stop = include_stop
        self._text = ""  # everything received
        self._emitted = 0  # characters of `_text` already released
        self.stopped = False

    def add(self, delta: str) -> str:
        """Feed new text; returns the part now safe to show (may be empty)."""
        if self.stopped:
            return ""
        if not self._stops:  # nothing to hold back
            return delta
        self._text += delta
        cut = self._stop_cut()
        if cut is not None:
            self.stopped = True
            return self._release(cut)
        return self._release(len(self._text) - self._held_back())

    def finish(self) -> str:
        """The held-back text, once the stream ended without a stop string."""
        return "" if self.stopped else self._release(len(self._text))

    def _release(self, end: int) -> str:
        delta = self._text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return delta

    def _stop_cut(self) -> int | None:
        """Where the output ends if a stop string occurs, else None."""
        best: int | None = None
        # A new match must end in the unreleased tail; start early enough to see it.
        start = max(0, self._emitted - max((len(s) for s in self._stops), default=0))
        for stop in self._stops:
            at = self._text.find(stop, start)
            if at == -1:
                continue
            end = at + len(stop) if self._include_stop else at
            best = end if best is None else min(best, end)
        return best

    def _held_back(self) -> int:
        """Characters at the end that may be the beginning of a stop string."""
        held = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._text)), 0, -1):
                if self._text.endswith(stop[:k]):
                    held = max(held, k)
                    break
        return held
