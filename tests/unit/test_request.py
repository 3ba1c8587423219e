"""What a `Request` refuses at construction, and its token view."""

from __future__ import annotations

import pytest

from engine.request import Request
from engine.sampling import SamplingParams


class Params:
    max_tokens = 4


@pytest.mark.parametrize("rid", ["", "a b", "a\tb", "r1\n"])
def test_request_id_without_whitespace(rid: str) -> None:
    # Transfer notifications split on spaces: an id with one would be unreadable there.
    with pytest.raises(ValueError, match="request id"):
        Request(rid, [1, 2], Params())


def test_request_refuses_an_empty_prompt() -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        Request("r1", [], Params())


def test_router_style_id_is_accepted() -> None:
    assert Request("cmpl-0123abcd", [1], Params()).request_id == "cmpl-0123abcd"


def test_token_ids_upto_reads_prompt_and_output_as_one_list() -> None:
    request = Request("r", [1, 2, 3], SamplingParams())
    request.output_token_ids.extend([4, 5])
    whole = request.all_token_ids
    for end in range(0, 7):
        view = request.token_ids_upto(end)
        expected = whole[:end]
        assert len(view) == len(expected) and list(view) == expected
        for start in range(-6, 7):
            for stop in (None, *range(-6, 7)):
                assert view[start:stop] == expected[start:stop]
        assert view[::2] == expected[::2]
        for index in range(-len(expected), len(expected)):
            assert view[index] == expected[index]
        with pytest.raises(IndexError):
            view[len(expected)]


def test_token_at_reads_across_the_prompt_and_the_output() -> None:
    request = Request("r", [1, 2, 3], SamplingParams())
    request.output_token_ids.extend([4, 5])
    assert [request.token_at(p) for p in range(5)] == request.all_token_ids
    with pytest.raises(IndexError):
        request.token_at(5)
