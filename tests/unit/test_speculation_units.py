"""The pieces of speculative decoding on their own: n-gram lookup, draft
acceptance, the drafter's back-off, verify lanes and where the cache
manager lets a verify draft."""

from __future__ import annotations

import numpy as np
import pytest

from engine.request import Request
from engine.sampling import SamplingParams
from engine.speculation.config import SpeculativeConfig, SpeculativeConfigError
from engine.speculation.drafts import FIRST_COOLDOWN, PAUSE_AFTER, Drafter
from engine.speculation.ngram import TokenBuffer, propose
from engine.speculation.verify import num_accepted
from kvcache.errors import IntegrityError
from kvcache.mamba_pool import MambaStatePool
from kvcache.verify_slots import VerifySlots


def arr(tokens: list[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64)


def test_lookup_takes_the_longest_suffix_and_its_latest_match() -> None:
    tokens = [1, 2, 3, 9, 9, 7, 2, 3, 4, 5, 6, 1, 2, 3]
    # "1 2 3" occurs at 0 only (its own occurrence at the end does not count).
    assert propose(arr(tokens), 3, 1, 3) == [9, 9, 7]
    # Only sizes up to 2: "2 3" occurs at 1 and 6; the latest wins.
    assert propose(arr(tokens), 3, 1, 2) == [4, 5, 6]
    assert propose(arr([5, 6, 7, 8]), 3, 1, 3) == []
    assert propose(arr([4, 4]), 3, 1, 3) == [4]
    assert propose(arr([1, 2, 1, 2]), 0, 1, 3) == []


def test_lookup_respects_the_minimum_size() -> None:
    tokens = [7, 1, 8, 2, 1]
    assert propose(arr(tokens), 2, 1, 3) == [8, 2]
    assert propose(arr(tokens), 2, 2, 3) == []


def test_token_buffer_grows() -> None:
    buffer = TokenBuffer([1, 2])
    for t in range(3, 100):
        buffer.extend([t])
    assert buffer.view().tolist() == list(range(1, 100))


def test_acceptance_stops_at_the_first_difference() -> None:
    assert num_accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert num_accepted([5, 6, 7], [5, 9, 7, 8]) == 1
    assert num_accepted([5, 6, 7], [4, 6, 7, 8]) == 0
    with pytest.raises(ValueError, match="need 4 sampled"):
        num_accepted([5, 6, 7], [5, 6, 7])


def test_sampling_every_position_keeps_the_target_distribution() -> None:
    """The statistical check: a token of a tiny vocabulary drawn from p at
    each position, drafts accepted while they match, gives p's distribution
    at the first position whatever the draft (point-mass rejection
    sampling)."""
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.3, 0.15, 0.05])
    trials = 40000
    for draft in range(4):
        first = np.empty(trials, dtype=np.int64)
        for t in range(trials):
            sampled = [int(rng.choice(4, p=p)), int(rng.choice(4, p=p))]
            accepted = num_accepted([draft], sampled)
            first[t] = draft if accepted else sampled[0]
        freq = np.bincount(first, minlength=4) / trials
        # Four standard errors of a proportion at these sizes.
        assert np.all(np.abs(freq - p) < 4 * np.sqrt(p * (1 - p) / trials))


def request(tokens: list[int], **params: object) -> Request:
    settings: dict[str, object] = {"max_tokens": 50}
    settings.update(params)
    return Request("r", tokens, SamplingParams(**settings))  # type: ignore[arg-type]


def test_drafter_limits_and_penalties() -> None:
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1))
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert drafter.propose(request(tokens), 10) == [3, 4, 5, 6]
    assert drafter.propose(request(tokens), 2) == [3, 4]
    near_end = request(tokens, max_tokens=3)
    near_end.output_token_ids = [1]
    # "... 1 2 1": the latest earlier "1" is followed by 2. Two more tokens
    # may come: the bonus token and one draft.
    assert Drafter(drafter.config).propose(near_end, 10) == [2]
    assert Drafter(drafter.config).propose(request(tokens, presence_penalty=0.5), 10) == []


def test_drafter_follows_new_tokens() -> None:
    drafter = Drafter(SpeculativeConfig(prompt_lookup_min=1))
    r = request([1, 2, 3, 9])
    assert drafter.propose(r, 3) == []
    r.output_token_ids += [1, 2]
    assert drafter.propose(r, 3) == [3, 9, 1]


def test_drafter_backs_off_after_misses_and_recovers() -> None:
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1))
    r = request([1, 2, 3, 1, 2, 3, 1, 2])
    assert len(drafter.propose(r, 3)) == 3
    drafter.record("r", 3, 1)
    assert len(drafter.propose(r, 3)) == 2  # one past what was accepted
    drafter.record("r", 2, 2)
    assert len(drafter.propose(r, 3)) == 3
    for _ in range(PAUSE_AFTER):
        drafter.propose(r, 3)
        drafter.record("r", 1, 0)
    paused = [drafter.propose(r, 3) for _ in range(FIRST_COOLDOWN)]
    assert paused == [[]] * FIRST_COOLDOWN
    assert drafter.propose(r, 3) != []
    stats = drafter.stats
    assert stats.verifies == 2 + PAUSE_AFTER
    assert stats.drafted_at[0] == 2 + PAUSE_AFTER and stats.accepted_at[:2] == [2, 1]


def test_config_refuses_bad_values() -> None:
    with pytest.raises(SpeculativeConfigError, match="method"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(SpeculativeConfigError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(SpeculativeConfigError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)


def test_verify_lane_keeps_the_accepted_state_without_copies() -> None:
    pool = MambaStatePool(2)
    own = pool.allocate("a")
    lanes = VerifySlots(range(2, 8), depth=3)
    assert lanes.take("a", 2) == (2, 3)
    lanes.settle("a", 1, 2, pool)  # the state after draft 1 sits in slot 3
    assert pool.slot_of("a") == 3
    assert lanes.take("a", 3) == (2, own, 4)  # the old slot took its place
    lanes.settle("a", 3, 3, pool)  # all accepted: the state is in its own slot
    assert pool.slot_of("a") == 3
    pool.check_integrity()
    assert sorted([*lanes.slots(), *pool.free_slots(), 3]) == list(range(8))


def test_verify_lanes_run_out_and_come_back() -> None:
    lanes = VerifySlots(range(4), depth=2)
    assert lanes.take("a", 1) is not None and lanes.take("b", 2) is not None
    assert lanes.take("c", 1) is None
    with pytest.raises(IntegrityError):
        lanes.check_integrity()
    lanes.cancel("a")
    assert lanes.take("c", 1) is not None
    lanes.step_done()
    lanes.check_integrity()
