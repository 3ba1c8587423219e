"""`AbortedIds`: aborts remembered until their late request arrives, then forgotten."""

from __future__ import annotations

import time

from engine.aborts import AbortedIds


def test_an_abort_is_taken_once() -> None:
    ids = AbortedIds()
    ids.add("r1")
    assert ids.take("r1")
    assert not ids.take("r1")
    assert not ids.take("never-aborted")


def test_aborts_expire_after_their_ttl() -> None:
    ids = AbortedIds(ttl_s=0.01)
    ids.add("r1")
    time.sleep(0.02)
    assert not ids.take("r1")
    assert len(ids) == 0


def test_the_oldest_aborts_go_first_past_the_bound() -> None:
    ids = AbortedIds(max_ids=2)
    for rid in ("a", "b", "c"):
        ids.add(rid)
    assert len(ids) == 2
    assert not ids.take("a")
    assert ids.take("b") and ids.take("c")
