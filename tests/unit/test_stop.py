"""Stop conditions over text streamed from a real byte-level BPE."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from engine.sampling import SamplingParams
from engine.stop import StopChecker
from models.embedded.tokenizer import train_tokenizer
from models.tokenizer import Tokenizer

EOS = 2


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(train_tokenizer(512), {}, (EOS,), None)


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _stream(
    tokenizer: Tokenizer, params: SamplingParams, token_ids: Sequence[int], prompt: str = "Hi"
) -> tuple[str, int, object]:
    """Feed tokens until the checker stops; return (final text, tokens used, decision)."""
    detok = tokenizer.detokenizer(_ids(tokenizer, prompt))
    checker = StopChecker(params, eos_token_ids=[EOS])
    text = ""
    for used, token in enumerate(token_ids, start=1):
        new_text = detok.push(token)
        text += new_text
        decision = checker.check(token, new_text)
        if decision.finished:
            if decision.truncate_to is not None:
                text = text[: decision.truncate_to]
            return text, used, decision
    return text + detok.finish(), len(token_ids), None


def test_eos_stops_unless_ignored(tokenizer: Tokenizer) -> None:
    ids = _ids(tokenizer, "the cat") + [EOS] + _ids(tokenizer, " sat")
    text, used, decision = _stream(tokenizer, SamplingParams(max_tokens=50), ids)
    assert (text, used) == ("the cat", len(ids) - len(_ids(tokenizer, " sat")))
    assert getattr(decision, "reason", None) == "stop"
    text, used, _ = _stream(tokenizer, SamplingParams(max_tokens=50, ignore_eos=True), ids)
    assert text == "the cat sat" and used == len(ids)


def test_stop_token_and_length(tokenizer: Tokenizer) -> None:
    ids = _ids(tokenizer, "one two three four five")
    params = SamplingParams(max_tokens=50, stop_token_ids=(ids[2],))
    _, used, decision = _stream(tokenizer, params, ids)
    assert used == 3 and getattr(decision, "stop_reason", None) == ids[2]
    _, used, decision = _stream(tokenizer, SamplingParams(max_tokens=2), ids)
    assert used == 2 and getattr(decision, "reason", None) == "length"


def test_stop_string_spanning_tokens_is_cut(tokenizer: Tokenizer) -> None:
    text = "The clockmaker opened the wooden shutters."
    ids = _ids(tokenizer, text)
    stop = "er ope"  # crosses the "clockmaker" / " opened" token boundary
    assert all(stop not in tokenizer.decode([token]) for token in ids)
    out, used, decision = _stream(tokenizer, SamplingParams(max_tokens=50, stop=(stop,)), ids)
    assert out == "The clockmak" and getattr(decision, "stop_reason", None) == stop
    assert used < len(ids)
    kept, _, _ = _stream(
        tokenizer,
        SamplingParams(max_tokens=50, stop=(stop,), include_stop_str_in_output=True),
        ids,
    )
    assert kept == "The clockmaker ope"


def test_earliest_ending_stop_string_wins(tokenizer: Tokenizer) -> None:
    ids = _ids(tokenizer, "abcdef")
    params = SamplingParams(max_tokens=50, stop=("cdef", "bc"))
    out, _, decision = _stream(tokenizer, params, ids)
    assert out == "a" and getattr(decision, "stop_reason", None) == "bc"


def test_releasable_holds_back_a_possible_stop_prefix() -> None:
    checker = StopChecker(SamplingParams(stop=("STOP", "x")), eos_token_ids=[EOS])
    assert checker.releasable(10) == 7
    assert StopChecker(SamplingParams(), eos_token_ids=[EOS]).releasable(10) == 10


def test_length_counts_tokens_generated_elsewhere() -> None:
    checker = StopChecker(SamplingParams(max_tokens=3), eos_token_ids=[EOS])
    # The first token came from the context worker; this checker sees token 2 and 3.
    assert not checker.check(10, "a", num_output_tokens=2).finished
    assert checker.check(11, "b").reason == "length"


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_deep_into_a_long_output_cuts_at_its_place(include: bool) -> None:
    """Deltas of one to three characters, the stop string split over three of
    them after 20,000 characters; a shorter stop string never appears."""
    params = SamplingParams(
        max_tokens=1 << 20, stop=("<|end|>", "!!"), include_stop_str_in_output=include
    )
    checker = StopChecker(params, eos_token_ids=[EOS])
    text = "ab" * 10_000 + "c<|e" + "nd" + "|>tail"
    deltas, at = [], 0
    while at < len(text):
        step = 1 + at % 3
        deltas.append(text[at : at + step])
        at += step
    decision = None
    for token, delta in enumerate(deltas):
        decision = checker.check(token + 10, delta)
        if decision.finished:
            break
    assert decision is not None and decision.stop_reason == "<|end|>"
    start = text.index("<|end|>")
    assert decision.truncate_to == (start + len("<|end|>") if include else start)
