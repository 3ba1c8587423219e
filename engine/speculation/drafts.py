"""Per-request drafting: what each request proposes for its next verify,
how far it may draft, and how it backs off when its drafts keep failing.

The scheduler asks `Drafter.propose` for every request about to decode and
reports each verify's outcome through `record`. Which requests draft:

- every decoding request, greedy or sampled (`engine.speculation.verify`
  keeps either exact), with `logprobs`, stop strings and seeds as without
  speculation;
- not one with repetition, presence or frequency penalties: each position's
  penalties would depend on the drafts before it, so such a request decodes
  one token a step;
- never past `max_tokens`.

With MTP the model drafts (`engine.speculation.mtp`): the request carries
the drafts of the step that sampled its last token, and this hands them to
the verify. MTP drafts do not back off: the MTP runs every step anyway.

Back-off (n-gram drafts): a request drafts up to `width` tokens, which grows by one after a
verify that accepted everything and shrinks to one past what was accepted
otherwise. After `PAUSE_AFTER` verifies in a row that accepted nothing it
stops drafting for `cooldown` steps, doubled each time up to `MAX_COOLDOWN`,
so a request whose text does not repeat costs a lookup a step and little
else. Any accepted draft resets the cooldown.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request
from engine.speculation.config import SpeculativeConfig
from engine.speculation.ngram import TokenBuffer, propose

PAUSE_AFTER = 3
FIRST_COOLDOWN = 4
MAX_COOLDOWN = 64


@dataclass
class _Drafting:
    tokens: TokenBuffer
    width: int
    misses: int = 0  # verifies in a row that accepted nothing
    cooldown: int = FIRST_COOLDOWN
    paused: int = 0  # steps left without drafting


@dataclass
class DraftStats:
    """Totals since the worker started, for `/metrics`."""

    verifies: int = 0  # verify steps of one request
    drafted: int = 0
    accepted: int = 0
    # accepted_at[i]: verifies whose draft at position i + 1 was accepted.
    accepted_at: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)


class Drafter:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._requests: dict[str, _Drafting] = {}
        k = config.num_speculative_tokens
        self.stats = DraftStats(accepted_at=[0] * k, drafted_at=[0] * k)

    def propose(self, request: Request, limit: int) -> list[int]:
        """At most `limit` drafts to verify after the request's last token
        (which must be its one uncomputed token)."""
        params = request.params
        if params.has_penalties:
            return []
        limit = min(limit, params.max_tokens - request.num_output_tokens - 1)
        if limit <= 0:
            return []
        if self.config.uses_model:
            # The model drafted them after the step that sampled the last
            # token (`engine.speculation.mtp`); they are good for one verify.
            drafts, request.drafts = request.drafts, ()
            return list(drafts[:limit])
        state = self._state(request)
        if state.paused:
            state.paused -= 1
            return []
        config = self.config
        return propose(
            state.tokens.view(),
            min(limit, state.width),
            config.prompt_lookup_min,
            config.prompt_lookup_max,
        )

    def record(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verify of `drafted` drafts accepted the first `accepted`."""
        stats = self.stats
        stats.verifies += 1
        stats.drafted += drafted
        stats.accepted += accepted
        for i in range(drafted):
            stats.drafted_at[i] += 1
        for i in range(accepted):
            stats.accepted_at[i] += 1
        state = self._requests.get(request_id)
        if state is None:
            return
        k = self.config.num_speculative_tokens
        state.width = min(k, state.width + 1) if accepted == drafted else min(k, accepted + 1)
        if accepted:
            state.misses, state.cooldown = 0, FIRST_COOLDOWN
            return
        state.misses += 1
        if state.misses >= PAUSE_AFTER:
            state.misses = 0
            state.paused = state.cooldown
            state.cooldown = min(2 * state.cooldown, MAX_COOLDOWN)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def _state(self, request: Request) -> _Drafting:
        state = self._requests.get(request.request_id)
        if state is None:
            state = _Drafting(
                TokenBuffer(request.all_token_ids), self.config.num_speculative_tokens
            )
            self._requests[request.request_id] = state
        known = len(state.tokens)
        if known < request.num_tokens:
            state.tokens.extend(request.token_ids_between(known, request.num_tokens))
        return state
