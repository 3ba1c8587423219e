"""Typed messages between the router and the worker actors.

They travel through Ray calls (pickled by Ray as plain dataclasses); none of
them carries a tensor. Cache bytes move only through the transceivers, which
the `TransferHandle` inside a `ContextResult` addresses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.multimodal import EncoderCacheEvent, ImageInput
from engine.request import FinishReason

if TYPE_CHECKING:
    from engine.samples import SampleStart
    from engine.sampling import SamplingParams
    from transfer.handle import TransferHandle


@dataclass(frozen=True)
class ContextRequest:
    """Context-only work: prefill `prompt_token_ids` and sample the first token."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Images whose embeddings replace the prompt's placeholders (VL models).
    images: tuple[ImageInput, ...] = ()


@dataclass(frozen=True)
class ContextResult:
    """The context phase's answer.

    `handle` addresses the pinned cache (a `transfer.TransferHandle`); it is
    None when the request already finished at its first token (EOS, a stop
    token, max_tokens == 1), in which case nothing stays pinned. A
    tensor-parallel context instance pins the cache on every rank: `handle`
    is rank 0's and `rank_handles` those of ranks 1.. in order; a puller
    pulls them all, rank 0's last (`all_handles`).
    """

    request_id: str
    first_token_id: int
    first_logprob: float | None = None
    first_top_logprobs: list[tuple[int, float]] | None = None
    handle: TransferHandle | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Wall-clock (time.time()) when the first token was sampled.
    first_token_time: float = field(default_factory=time.time)
    rank_handles: tuple[TransferHandle, ...] = ()
    # MTP drafting: the drafts after the first token, which the generation
    # worker verifies in its first step (`engine.speculation.mtp`).
    draft_token_ids: tuple[int, ...] = ()
    # n samples (`engine.samples`): every sample's first token (sample 0's
    # is `first_token_id`) and whether it ended there; the handle is set
    # while any runs on, and the generation worker forks those.
    samples: tuple[SampleStart, ...] = ()

    @property
    def all_handles(self) -> list[TransferHandle]:
        """Every context rank's handle, rank 0's last; empty when nothing is pinned."""
        return [] if self.handle is None else [*self.rank_handles, self.handle]


@dataclass(frozen=True)
class GenerationRequest:
    """Work for a generation (or aggregated) worker.

    With `context` set, the prompt's cache lives on a context worker and is
    pulled through `context.handle`; the first token is `context.first_token_id`.
    With `context` None the worker runs the whole request itself (aggregated
    mode and conditional disaggregation); only then does it carry `images`,
    since a pulled cache already holds their effect.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    context: ContextResult | None = None
    images: tuple[ImageInput, ...] = ()


@dataclass(frozen=True)
class SubmitReceipt:
    """A generation worker's answer to `submit_many`: the incarnation that
    accepted the requests, and why it refused those it did not accept (by
    request id; a refused request has no events)."""

    incarnation: str
    refused: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PrefetchRequest:
    """Start pulling a prompt's cache while its context worker still prefills it
    (chunk-pipelined transfer).

    The generation worker allocates blocks for the whole prompt and asks
    `holder` (the context worker's actor) for finished blocks with
    `blocks_ready`, pulling each batch as it is offered and the rest (with the
    Mamba state) once the prompt is published. The `GenerationRequest` that
    follows with the `ContextResult` joins this pull instead of starting one.
    """

    request_id: str
    prompt_token_ids: list[int]
    holder: Any  # a Ray ActorHandle of a ContextWorker
    images: tuple[ImageInput, ...] = ()


@dataclass(frozen=True)
class BlocksReady:
    """A context worker's answer to `blocks_ready(request_id, num_pulled)`.

    `handle` addresses logical blocks `[first_block, end_block)` of the
    prompt. With `final` False they are offered blocks of a prompt still
    prefilling (pull them with `release=False`); with `final` True the prompt
    is published and the handle covers every block from `first_block` on plus
    the Mamba state (pull and release). `handle` None: there is nothing to
    pull (the prompt failed, was aborted or finished at its first token);
    with `pending` set instead, nothing new was ready in time: ask again.
    """

    request_id: str
    handle: TransferHandle | None
    first_block: int = 0
    end_block: int = 0
    final: bool = False
    pending: bool = False


@dataclass(frozen=True)
class TokenEvent:
    """One chunk of a token stream: new tokens of one request, in order.

    The last event of a stream has `finish_reason` set ("stop", "length",
    "abort" or "error"); with "error", `error` says what to change.

    A generation worker that pulls a cache first sends one event with no
    tokens and no `finish_reason` once the pull completed, as the request
    joins its batch (`cache_ready`: the next token is one step away): up
    to then the request can still be re-run from its prefill elsewhere.
    A pulled request it preempts but cannot compute again (its images were
    encoded on the context worker) ends with `finish_reason` "preempted"
    (`handed_back`): the router resumes it through a new context prefill.
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Wall-clock (time.time()) when these tokens were sampled.
    timestamp: float = field(default_factory=time.time)
    cache_ready: bool = False
    # A context worker's handoff with MTP drafting: the drafts after the
    # first token, for the generation worker's first verify.
    draft_token_ids: list[int] = field(default_factory=list)
    # n samples (`engine.samples`): which sample the tokens are of, and why
    # it ended when it ends before the stream does (only the stream's last
    # event sets `finish_reason`).
    sample: int = 0
    sample_finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def first_of(cls, context: ContextResult) -> TokenEvent:
        """The event of the first token, which the context worker sampled."""
        return cls(
            request_id=context.request_id,
            token_ids=[context.first_token_id],
            logprobs=None if context.first_logprob is None else [context.first_logprob],
            top_logprobs=(
                None if context.first_top_logprobs is None else [context.first_top_logprobs]
            ),
            finish_reason=context.finish_reason,
            num_prompt_tokens=context.num_prompt_tokens,
            num_cached_tokens=context.num_cached_tokens,
            timestamp=context.first_token_time,
        )

    @classmethod
    def firsts_of(cls, context: ContextResult) -> list[TokenEvent]:
        """The events of every sample's first token (one without samples);
        when all of them ended there, the last event ends the stream."""
        if not context.samples:
            return [cls.first_of(context)]
        done = all(start.finished for start in context.samples)
        events = []
        for start in context.samples:
            last = done and start is context.samples[-1]
            events.append(
                cls(
                    request_id=context.request_id,
                    token_ids=[start.token_id],
                    logprobs=None if start.logprob is None else [start.logprob],
                    top_logprobs=None if start.top_logprobs is None else [start.top_logprobs],
                    finish_reason=start.finish_reason if last else None,
                    num_prompt_tokens=context.num_prompt_tokens,
                    num_cached_tokens=context.num_cached_tokens,
                    timestamp=context.first_token_time,
                    sample=start.index,
                    sample_finish_reason=None if last else start.finish_reason,
                )
            )
        return events

    @classmethod
    def ended(
        cls, request_id: str, reason: str, error: str | None = None, num_prompt_tokens: int = 0
    ) -> TokenEvent:
        """The final event of a request that ends without (more) tokens:
        `reason` "error" (with `error` saying why) or "abort"."""
        return cls(
            request_id=request_id,
            token_ids=[],
            finish_reason=reason,
            error=error,
            num_prompt_tokens=num_prompt_tokens,
        )

    @property
    def handed_back(self) -> bool:
        return self.finish_reason == FinishReason.PREEMPTED.value


@dataclass(frozen=True)
class StepTokens:
    """One engine step's plain new tokens as columns: row i is one token
    (`token_ids[i]`) of request `request_ids[i]`, not its last, without
    logprobs, all sampled at `timestamp`. Every other event of the step (a
    last token, tokens with logprobs, errors) travels as a `TokenEvent`
    beside it. One object per step, not one per running request: built and
    pickled on the worker in a small fraction of the time one `TokenEvent`
    a row took (docs/performance.md); the reader builds the events
    (`event(i)`) for the requests it has open.
    """

    timestamp: float
    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: list[int] = field(default_factory=list)
    num_cached_tokens: list[int] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)  # each row's sample index

    def __len__(self) -> int:
        return len(self.request_ids)

    def event(self, row: int) -> TokenEvent:
        return TokenEvent(
            request_id=self.request_ids[row],
            token_ids=[self.token_ids[row]],
            num_prompt_tokens=self.num_prompt_tokens[row],
            num_cached_tokens=self.num_cached_tokens[row],
            timestamp=self.timestamp,
            sample=self.samples[row] if self.samples else 0,
        )


# What a worker's event stream carries, in order, one list per message.
EventItem = TokenEvent | StepTokens


@dataclass(frozen=True)
class RankCacheUsage:
    """One rank's cache of an instance (its own KV heads' blocks and its Mamba
    slots); block ids and slots are rank 0's, so every rank holds the same
    ones in use. A one-rank instance reports rank 0 alone."""

    rank: int
    num_total_blocks: int
    num_used_blocks: int
    num_mamba_slots: int  # 0 for models without Mamba layers
    num_used_mamba_slots: int


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's occupancy, for load-aware routing."""

    worker_id: str
    role: str  # "context", "generation" or "aggregated"
    num_waiting: int
    num_running: int
    num_transferring: int  # pulls in flight (generation) or pinned handoffs (context)
    num_free_blocks: int
    num_total_blocks: int
    num_free_mamba_slots: int
    num_tokens_in_flight: int  # tokens of every queued or running request
    # Images the vision encoder served from its cache / ran (VL models).
    encoder_cache_hits: int = 0
    encoder_cache_misses: int = 0
    # Hybrid prefix reuse: prompts that found / did not find a Mamba
    # snapshot, snapshots evicted for room / dropped with a KV block under
    # them, prompt tokens skipped by resuming, snapshots held and slots.
    snapshot_hits: int = 0
    snapshot_misses: int = 0
    snapshot_evictions: int = 0
    snapshot_drops: int = 0
    snapshot_resumed_tokens: int = 0
    num_snapshots: int = 0
    num_snapshot_slots: int = 0
    # Speculative decoding since start: verifies (one request's, one step),
    # drafts verified and accepted, and per draft position (1, 2, ...) the
    # verifies that reached it and that accepted it.
    spec_verifies: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_drafted_at: tuple[int, ...] = ()
    spec_accepted_at: tuple[int, ...] = ()
    ranks: tuple[RankCacheUsage, ...] = ()
    # Engine steps run since start, and the wall seconds they took (the rest
    # of the worker's time its engine idled or waited for the event loop).
    num_steps: int = 0
    step_busy_s: float = 0.0
    # How long the step on the compute thread has run (0 between steps).
    step_in_flight_s: float = 0.0
    node_ip: str = ""  # the Ray node this worker runs on ("" outside Ray)


@dataclass(frozen=True)
class KVEventBatch:
    """Cache events (blocks stored / removed) since the last drain, in order;
    `events` holds whatever the worker's KV cache manager reports, and
    `encoder_events` the images its encoder cache took in or dropped."""

    worker_id: str
    events: list[Any]
    encoder_events: list[EncoderCacheEvent] = field(default_factory=list)
    # Mamba snapshots stored / removed (`kvcache.snapshots.SnapshotEvent`).
    snapshot_events: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class WorkerReport:
    """What the router polls from a worker, in one call: its load and the
    cache events since the previous report."""

    load: WorkerLoad
    kv_events: KVEventBatch


@dataclass(frozen=True)
class WorkerHealth:
    worker_id: str
    role: str
    healthy: bool
    detail: str = ""
    torch_threads: int = 0  # intra-op threads, sized from the Ray CPU grant on CPU


@dataclass(frozen=True)
class WorkerIntegrity:
    """A worker's cache bookkeeping, checked between engine steps.

    `ok` is False when the manager's `check_integrity()` found problems
    (listed in `problems`). An idle worker holds no request and no pin, and
    has `num_free_blocks == num_usable_blocks` and every Mamba slot free.
    """

    worker_id: str
    ok: bool
    problems: list[str]
    num_free_blocks: int
    num_usable_blocks: int
    num_free_mamba_slots: int
    num_mamba_slots: int
    num_requests: int  # queued or running in the engine, or in transfer
    num_pinned: int  # caches published and not yet released (context side, every rank)

    @property
    def idle(self) -> bool:
        return (
            self.ok
            and self.num_requests == 0
            and self.num_pinned == 0
            and self.num_free_blocks == self.num_usable_blocks
            and self.num_free_mamba_slots == self.num_mamba_slots
        )
