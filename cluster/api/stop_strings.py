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

from engine.stop import first_stop


class StopStringFilter:
    """Releases text up to any stop string. Only the text not yet released
    is kept (at most the longest stop string's length plus the newest delta):
    released text holds no start of a stop string, since a suffix that could
    begin one is what gets held back."""

    def __init__(self, stop_strings: Sequence[str] = (), include_stop: bool = False) -> None:
        self._stops = [s for s in stop_strings if s]
        self._include_stop = include_stop
        self._pending = ""  # received, not yet released
        self.stopped = False

    def add(self, delta: str) -> str:
        """Feed new text; returns the part now safe to show (may be empty)."""
        if self.stopped:
            return ""
        if not self._stops:  # nothing to hold back
            return delta
        self._pending += delta
        cut = self._stop_cut()
        if cut is not None:
            self.stopped = True
            return self._release(cut)
        return self._release(len(self._pending) - self._held_back())

    def finish(self) -> str:
        """The held-back text, once the stream ended without a stop string."""
        return "" if self.stopped else self._release(len(self._pending))

    def _release(self, end: int) -> str:
        released, self._pending = self._pending[:end], self._pending[end:]
        return released

    def _stop_cut(self) -> int | None:
        """Where the released text ends if a stop string occurs, else None.

        The stop string that ends first wins (on a tie, the first listed), as
        on the workers, whatever the deltas' boundaries."""
        match = first_stop(self._pending, self._stops)
        if match is None:
            return None
        start, end, _ = match
        return end if self._include_stop else start

    def _held_back(self) -> int:
        """Characters at the end that may be the beginning of a stop string."""
        held = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._pending)), 0, -1):
                if self._pending.endswith(stop[:k]):
                    held = max(held, k)
                    break
        return held
