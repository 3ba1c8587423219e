"""A stand-in for a device event, completed by the test, for barrier tests."""

from __future__ import annotations

import threading

from engine.step_event import StepEvent


class GatedEvent:
    """A `StepEvent` that is done once the test calls `complete`; `waited`
    says whether anyone waited for it before that."""

    def __init__(self, seconds: float = 0.0) -> None:
        self._done = threading.Event()
        self.seconds = seconds  # device time since any earlier event
        self.waited = False

    def complete(self) -> None:
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self.waited = True
        if not self._done.wait(timeout=30):
            raise TimeoutError("the test never completed this event")

    def seconds_since(self, earlier: StepEvent) -> float:
        assert self.done()
        return self.seconds
