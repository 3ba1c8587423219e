"""A request's seen tokens for the penalties, kept from step to step."""

from __future__ import annotations

import random

from engine.token_history import TokenHistory, history_for


def _as_dict(history: TokenHistory) -> dict[int, float]:
    ids, counts = history.ids.tolist(), history.counts.tolist()
    assert len(set(ids)) == len(ids), "an id listed twice"
    return dict(zip(ids, counts, strict=True))


def test_prompt_ids_once_then_output_counts() -> None:
    history = TokenHistory([5, 9, 5], vocab=10)
    history.sync([9, 7, 9])
    assert history.ids.tolist() == [5, 9, 7]
    assert history.counts.tolist() == [0.0, 2.0, 1.0]


def test_ids_outside_the_vocabulary_are_left_out() -> None:
    history = TokenHistory([-1, 3, 10, 12], vocab=10)
    history.sync([10, 4, -5, 4])
    assert _as_dict(history) == {3: 0.0, 4: 2.0}


def test_growing_one_token_a_step_equals_counting_at_once() -> None:
    """Past the initial capacity (hundreds of distinct ids), against a
    history built from the whole output at every step."""
    rng = random.Random(7)
    vocab = 1000
    prompt = [rng.randrange(vocab) for _ in range(50)]
    output: list[int] = []
    history = TokenHistory(prompt, vocab)
    for _ in range(600):
        output.append(rng.randrange(vocab + 5) - 2)
        history.sync(output)
        if len(output) % 97 == 0:
            whole = TokenHistory(prompt, vocab)
            whole.sync(output)
            assert _as_dict(history) == _as_dict(whole)
    expected = {t: float(output.count(t)) for t in set(prompt + output) if 0 <= t < vocab}
    assert _as_dict(history) == expected
    assert history.output_len == 600


def test_history_for_reuses_a_history_that_follows_the_request() -> None:
    cache: dict[str, TokenHistory] = {}
    first = history_for(cache, "r", [1, 2], [3], vocab=10)
    again = history_for(cache, "r", [1, 2], [3, 3], vocab=10)
    assert again is first and _as_dict(again) == {1: 0.0, 2: 0.0, 3: 2.0}


def test_history_for_rebuilds_one_that_no_longer_follows() -> None:
    """A shorter output than counted (or another prompt length, or another
    vocabulary) cannot be caught up with: counted from scratch."""
    cache: dict[str, TokenHistory] = {}
    history_for(cache, "r", [1, 2], [3, 3, 4], vocab=10)
    shorter = history_for(cache, "r", [1, 2], [5], vocab=10)
    assert _as_dict(shorter) == {1: 0.0, 2: 0.0, 5: 1.0}
    other_prompt = history_for(cache, "r", [6], [5], vocab=10)
    assert _as_dict(other_prompt) == {6: 0.0, 5: 1.0}
    wider = history_for(cache, "r", [6], [5, 11], vocab=20)
    assert _as_dict(wider) == {6: 0.0, 5: 1.0, 11: 1.0}
