"""Per-request state shared by the scheduler, the model runner and the workers.

A request's tokens are `prompt_token_ids + output_token_ids`. The cache holds
the first `num_computed_tokens` of them; a step computes some of the rest.
After a decode step the newest sampled token is always the one token not yet
in the cache, so a running request in the decode phase has exactly one
uncomputed token:

    tokens:    p0 p1 p2 p3 | o0 o1
    computed:  p0 p1 p2 p3   o0        num_computed_tokens = 5, num_tokens = 6

Preemption by recompute resets `num_computed_tokens` to 0; the next prefill
then covers prompt and output alike.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, overload

from engine.multimodal import ImageInput

if TYPE_CHECKING:  # sampling imports torch; request state stays pure Python
    from engine.samples import SampleStart
    from engine.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, stop token or stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the client or the router
    HANDOFF = "handoff"  # context phase done; the cache waits for the generation side
    # Generation side: preempted, and its images' bytes stayed with the
    # context worker, so only a new context prefill can run it on.
    PREEMPTED = "preempted"
    ERROR = "error"  # the request can never run here; `Request.error` says why


@dataclass(eq=False)
class Request:
    """One sequence in flight.

    The scheduler never reads `params`, so it runs without torch; the engine
    core and the sampler do.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_preemptions: int = 0
    # Per output token: its logprob and the top alternatives, when asked for.
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Prompt tokens found in the prefix cache on first admission.
    num_cached_tokens: int = 0
    # Images whose embeddings replace placeholder tokens of the prompt, in
    # prompt order (context and aggregated workers only).
    images: tuple[ImageInput, ...] = ()
    # MTP drafting: the drafts to verify after the last token, from the step
    # that sampled it (or the context worker's, for a pulled request).
    drafts: tuple[int, ...] = ()
    # n samples (`engine.samples`): a forked sample names its request and
    # its index; the request's prefill records every sample's first token
    # (`sample_starts`, index order) for the handoff or the fork.
    sample_of: str | None = None
    sample_index: int = 0
    sample_starts: tuple[SampleStart, ...] = ()

    def __post_init__(self) -> None:
        if not self.request_id or any(c.isspace() for c in self.request_id):
            # Transfer notifications carry the id as a space-separated field.
            raise ValueError(
                f"request id {self.request_id!r} must be non-empty, without whitespace"
            )
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r} has an empty prompt")

    @property
    def stream_id(self) -> str:
        """The id its events carry: its request's, for a forked sample."""
        return self.sample_of or self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without building the whole list (a
        decode step needs one token of a long sequence)."""
        prompt = len(self.prompt_token_ids)
        if end <= prompt:
            return self.prompt_token_ids[start:end]
        if start >= prompt:
            return self.output_token_ids[start - prompt : end - prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt]

    def token_at(self, position: int) -> int:
        """`all_token_ids[position]`, for a non-negative position."""
        prompt = len(self.prompt_token_ids)
        if position < prompt:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - prompt]

    def token_ids_upto(self, end: int) -> TokenIds:
        """`all_token_ids[:end]` as a view: a step allocating for every running
        request reads only the blocks it fills, not the whole sequence."""
        return TokenIds(self, end)

    @property
    def can_recompute(self) -> bool:
        """Whether preemption by recompute can rebuild this request's cache: not
        when it holds images without their bytes (pulled from a context worker)."""
        return all(image.data for image in self.images)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(
        self,
        token_id: int,
        logprob: float | None = None,
        top_logprobs: list[tuple[int, float]] | None = None,
    ) -> None:
        """Record a sampled token (and its logprobs, when computed)."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error


class TokenIds(Sequence[int]):
    """The first `end` of a request's prompt + output ids, read in place."""

    def __init__(self, request: Request, end: int) -> None:
        self.request = request
        self.end = min(end, request.num_tokens)

    def __len__(self) -> int:
        return self.end

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self.end)
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return self.request.token_ids_between(start, stop)
        if index < 0:
            index += self.end
        if not 0 <= index < self.end:
            raise IndexError(f"token index {index} outside 0..{self.end - 1}")
        return self.request.token_ids_between(index, index + 1)[0]
