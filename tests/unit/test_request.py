"""What a `Request` refuses at construction."""

from __future__ import annotations

import pytest

from engine.request import Request


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
