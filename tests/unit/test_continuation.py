"""The next attempt of a disaggregated request after a sent token (pure Python)."""

from __future__ import annotations

from cluster.routing.continuation import Continuation
from engine.messages import TokenEvent
from engine.sampling import SamplingParams


def test_a_fresh_request_runs_as_asked() -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0)
    continuation = Continuation([1, 2, 3], params)
    assert continuation.prompt == [1, 2, 3] and continuation.params is params
    event = TokenEvent("r", [9], num_prompt_tokens=3)
    assert continuation.event(event) is event


def test_each_sent_token_moves_into_the_prompt_and_out_of_max_tokens() -> None:
    continuation = Continuation([1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0))
    continuation.advance([40])
    continuation.advance([41])
    assert continuation.prompt == [1, 2, 3, 40, 41]
    assert continuation.params.max_tokens == 6
    assert continuation.params.temperature == 0.0
    assert continuation.sent == [40, 41]


def test_events_of_a_resumed_attempt_report_the_callers_prompt_length() -> None:
    continuation = Continuation([1, 2, 3], SamplingParams(max_tokens=8))
    continuation.advance([40])
    event = continuation.event(TokenEvent("r", [41], num_prompt_tokens=4, num_cached_tokens=2))
    assert event.num_prompt_tokens == 3
    assert event.token_ids == [41] and event.num_cached_tokens == 2
