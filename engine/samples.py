"""n samples of one prompt (`SamplingParams.n`): one prefill, n sequences.

The request's last prefill chunk samples n first tokens from the same
logits, row i with sample i's own generator (`ModelRunner`). Sample 0 is the
request itself; sample i > 0 becomes a request of its own,
`sample_id(request_id, i)`, forked from it: its cache shares the prompt's
full blocks and copies the rest (`KVCacheManager.fork`). A context worker
does not fork: its `ContextResult.samples` carries every sample's first
token, and the generation worker forks after the pull (`EngineCore.add_prefilled`).

Every sample's events carry the request's id and the sample's index
(`TokenEvent.sample`). A sample that ends while others run says so in
`TokenEvent.sample_finish_reason`; only the last one to end sets
`finish_reason`, so a stream ends once, when every sample has ended, and an
abort of the request id ends every sample.

Seeds: sample 0 draws from `seed` itself (so its text is that of n = 1),
sample i from `sample_seed(seed, i)`, so the set is reproducible.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from engine.request import FinishReason, Request

if TYPE_CHECKING:
    from engine.sampling import SamplingParams

# The most samples one request may ask for (`n`).
MAX_SAMPLES = 16

_SEED_BITS = 63


@dataclass(frozen=True)
class SampleStart:
    """One sample's first token, as the prefill sampled it; `finish_reason`
    is set when the sample ends there."""

    index: int
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def sample_id(request_id: str, index: int) -> str:
    """The engine's id of sample `index` of `request_id` (sample 0: the request's own)."""
    return request_id if index == 0 else f"{request_id}#{index}"


def sample_seed(seed: int | None, index: int) -> int | None:
    """Sample `index`'s seed: `seed` for sample 0, else one derived from (seed, index)."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - _SEED_BITS)


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params sample `index` runs with: one sequence, its own seed."""
    return replace(params, n=1, seed=sample_seed(params.seed, index))


def forks_here(request: Request) -> bool:
    """Whether the request's next sampled token is the first of several samples."""
    return getattr(request.params, "n", 1) > 1 and not request.output_token_ids


def sample_request(parent: Request, start: SampleStart) -> Request:
    """Sample `start.index` of `parent` as a request of its own, its first token appended."""
    child = Request(
        sample_id(parent.request_id, start.index),
        parent.prompt_token_ids,
        sample_params(parent.params, start.index),
        images=parent.images,
        sample_of=parent.request_id,
        sample_index=start.index,
        num_cached_tokens=parent.num_cached_tokens,
    )
    child.append_output(start.token_id, start.logprob, start.top_logprobs)
    return child


class SampleFamilies:
    """The samples still running of each request that has several (by
    request id): the last one to end ends the request's stream."""

    def __init__(self) -> None:
        self._live: dict[str, set[str]] = {}

    def open(self, request_id: str, members: Iterable[str]) -> None:
        self._live[request_id] = set(members)

    def members(self, request_id: str) -> list[str]:
        """The engine ids of the request's running samples (just itself
        without a family)."""
        live = self._live.get(request_id)
        return [request_id] if live is None else sorted(live)

    def end(self, request: Request) -> bool:
        """`request` (a sample) ended: whether its stream ends with it."""
        family = request.sample_of or request.request_id
        live = self._live.get(family)
        if live is None:
            return True
        live.discard(request.request_id)
        if live:
            return False
        del self._live[family]
        return True

    def forget(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._live)


def finish_value(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value
