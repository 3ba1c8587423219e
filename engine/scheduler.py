"""Continuous batching with chunked prefill and preemption by recompute.

Each step gets a token budget (`max_num_tokens`) and a sequence cap
(`max_batch_size`). The scheduler spends the budget in this order:

1. running requests in the decode phase (one token each), oldest first;
2. running requests still in a chunked prefill, oldest first;
3. waiting requests (preempted ones sit at the head), each taking a prefill
   chunk of whatever budget is left, while the step's prompt work stays
   within what `PromptPacing` allows.

Prompts share a step only while that is cheap. Once one prompt keeps the
device busy for a while, a second one in the same step gains no throughput
(the products are compute-bound from a few hundred rows on a CPU) and makes
the first prompt's first token wait for the second's compute: two prompts
in one step finish together, each as late as both alone would
(docs/performance.md, "Engine").
`PromptPacing` learns the device's seconds per token from the steps that
ran, and a step takes another waiting prompt only while its prompt tokens
stay within `PROMPT_STEP_TARGET_S` of compute; the first prompt of a step
always goes in (chunked to the budget as before), so nothing starves. When
more than `PACED_BACKLOG` prompts wait, the device is behind and steps pack
prompts into the budget again: their fixed cost is then worth sharing.

When a running request cannot get the blocks for its next tokens, another
running request is preempted (its blocks and Mamba slot freed), and that
repeats until the allocation fits or the request itself was the victim.
Victims are chosen newest first among the requests this worker can compute
again; only when none is left does the newest of the others go:

- a request that can be recomputed forgets its computed tokens and goes back
  to the head of the waiting queue (preemption by recompute);
- a request whose images were encoded on a context worker cannot (only their
  hashes came with its cache): it is *handed back*, ending here with
  `FinishReason.PREEMPTED`, and the router resumes it with a fresh context
  prefill of its prompt and the tokens already sent (`cluster.routing.continuation`).

With speculative decoding a decoding request may bring drafts
(`engine.speculation`): its step computes its last token and up to k drafts
(a verify), from the same budget, and `commit` advances it by what the
verify accepted. Drafts never cost a preemption: when their blocks or
verify slots are short, the request decodes one token instead.

A request that needs more tokens than the whole cache holds fails with
`FinishReason.ERROR` instead of looping. Waiting requests never preempt
running ones; they wait until blocks come free.

Pure Python over the manager's integer bookkeeping: no torch here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.request import FinishReason, Request, RequestStatus
from kvcache.hashing import ContentSpan
from kvcache.snapshots import StateCopies


class DraftSource(Protocol):
    """Where decoding requests get their drafts (`engine.speculation.drafts.Drafter`)."""

    def propose(self, request: Request, limit: int) -> Sequence[int]: ...


class BlockManager(Protocol):
    """What the scheduler needs from a KV cache manager (V1 or V2)."""

    # Whether allocation publishes filled blocks for reuse (it then needs their tokens).
    enable_block_reuse: bool

    @property
    def block_size(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    def allocate_slots(
        self,
        request_id: str,
        num_tokens: int,
        token_ids: Sequence[int] | None = None,
        spans: Sequence[ContentSpan] = (),
    ) -> bool: ...

    def match_prefix(
        self, request_id: str, token_ids: Sequence[int], spans: Sequence[ContentSpan] = ()
    ) -> int: ...

    def free(self, request_id: str, num_computed: int | None = None) -> None: ...

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> bool: ...

    def chunk_limit(self, request_id: str, start: int, num_new: int) -> int: ...

    def draft_limit(self, request_id: str, start: int, num_drafts: int) -> int: ...

    def take_verify_slots(self, request_id: str, num_drafts: int) -> tuple[int, ...] | None: ...

    def settle_verify(
        self, request_id: str, accepted: int, drafted: int, token_ids: Sequence[int] | None
    ) -> None: ...

    def cancel_verify(self, request_id: str) -> None: ...

    def take_copies(self) -> StateCopies: ...

    def step_done(self) -> None: ...


# A step takes a second (third, ...) waiting prompt only while its prompt
# tokens stay within this much compute at the learned seconds per token. At
# 0.1 s a step's fixed costs (scheduling, building the batch, per-layer
# calls, sampling: a few ms on a CPU) stay a few percent of a step that
# batches prompts, and a prompt that alone computes that long is never
# delayed by another. At the per-token costs measured on a CPU
# (docs/performance.md, "Engine") every 256-token prompt of SmolLM2-135M gets
# a step of its own, while the benchmarks' small anchor Llama still packs
# whole steps.
PROMPT_STEP_TARGET_S = 0.1
# Pacing holds while at most this many prompts wait. A longer queue means
# the device is behind, and then a step's fixed cost is worth sharing: a CPU
# step streams every weight once, so one prompt a step through a burst of
# 32 served about a tenth fewer output tokens/s offline than packed steps
# (docs/performance.md, "Engine").
PACED_BACKLOG = 4
# Steps of fewer prompt tokens say little about the cost of a prompt (fixed
# costs dominate them) and are not learned from.
_MIN_PACED_TOKENS = 64
# Weight of the newest step in the running estimate when it was slower than
# the estimate; a faster step sets it at once (see `PromptPacing.observe`).
_PACING_WEIGHT = 0.25


class PromptPacing:
    """The device's compute time per token, learned from steps that ran, and
    how many prompt tokens a step may therefore take before it stops adding
    waiting prompts. Until a step with `_MIN_PACED_TOKENS` or more prompt
    tokens, at least half of its tokens, has been observed there is no
    limit."""

    def __init__(self, target_s: float = PROMPT_STEP_TARGET_S) -> None:
        self.target_s = target_s
        self.seconds_per_token: float | None = None

    def observe(self, num_tokens: int, prompt_tokens: int, seconds: float) -> None:
        """Learn from a step of `num_tokens` tokens, `prompt_tokens` of them in
        prompt chunks, whose model ran `seconds`. Only steps mostly made of
        prompt tokens teach it: a decode token costs far more than a prompt
        token (it reads the whole context and, in a small batch, the weights).

        A faster step than the estimate sets it at once, a slower one moves it
        a quarter of the way: what slows a step down comes and goes (the first
        step of a shape on a GPU, which builds kernels and plans and can take
        several times the later ones; other processes on a CPU's cores),
        while a fast step shows what the device does."""
        if prompt_tokens < _MIN_PACED_TOKENS or 2 * prompt_tokens < num_tokens or seconds <= 0:
            return
        rate = seconds / num_tokens
        known = self.seconds_per_token
        if known is None or rate < known:
            self.seconds_per_token = rate
        else:
            self.seconds_per_token = known + _PACING_WEIGHT * (rate - known)

    def admits(self, prompt_tokens: int, more: int) -> bool:
        """Whether a step that already computes `prompt_tokens` prompt tokens
        takes `more` of another prompt; one with none yet always does."""
        if prompt_tokens == 0 or self.seconds_per_token is None:
            return True
        return (prompt_tokens + more) * self.seconds_per_token <= self.target_s


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_tokens: int
    max_batch_size: int
    # Total KV capacity in tokens: a prompt longer than this fails at once.
    max_model_tokens: int
    enable_prefix_match: bool = False
    # Most requests waiting for their first step; None = no bound. The
    # router's admission bound normally keeps queues far below it.
    max_num_waiting: int | None = None


@dataclass(frozen=True)
class ScheduledSequence:
    """One request's share of a step: tokens `[start, start + num_new_tokens)`.

    `samples` is True when the chunk reaches the request's last known token,
    so the logits at its last position give the next token. Both are fixed
    when the step is scheduled.
    """

    request: Request
    num_new_tokens: int
    start: int
    samples: bool
    # A verify: the drafts after the request's last token (the chunk's other
    # tokens), and on a hybrid model the Mamba scratch slots of their positions.
    drafts: tuple[int, ...] = ()
    verify_slots: tuple[int, ...] = ()

    @classmethod
    def of(cls, request: Request, num_new_tokens: int) -> ScheduledSequence:
        start = request.num_computed_tokens
        return cls(request, num_new_tokens, start, start + num_new_tokens == request.num_tokens)


@dataclass
class SchedulerOutput:
    sequences: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Preempted requests that cannot be recomputed here: they end with
    # `FinishReason.PREEMPTED` and resume through a new context prefill.
    handed_back: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)
    # Mamba state loads and saves beside the forward (hybrid prefix reuse).
    copies: StateCopies = field(default_factory=StateCopies)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.sequences)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens of the step's prompt chunks (a decode computes one)."""
        return sum(s.num_new_tokens for s in self.sequences if s.num_new_tokens > 1)

    @property
    def is_empty(self) -> bool:
        return not self.sequences


class CapacityError(RuntimeError):
    """A request needs more KV cache than this worker has in total."""


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_num_waiting`; another worker may take the request."""


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, manager: BlockManager, drafter: DraftSource | None = None
    ) -> None:
        self.config = config
        self.manager = manager
        self.drafter = drafter
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.pacing = PromptPacing()

    # ---- queue management -------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request for prefill. Raises CapacityError if its prompt can
        never fit in this worker's cache, QueueFullError if the waiting queue
        is at its bound."""
        if request.num_tokens > self.config.max_model_tokens:
            raise CapacityError(
                f"request {request.request_id!r} has {request.num_tokens} tokens but the KV "
                f"cache holds {self.config.max_model_tokens}; raise max_tokens or shorten "
                f"the prompt"
            )
        limit = self.config.max_num_waiting
        if limit is not None and len(self.waiting) >= limit:
            raise QueueFullError(
                f"request {request.request_id!r} refused: {limit} requests already wait "
                "on this worker (max_num_waiting); retry later or add instances"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Admit a request whose cache already holds `num_computed_tokens`
        (pulled from a context worker); its blocks are allocated by the caller."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def remove(self, request: Request, free_blocks: bool = True) -> None:
        """Take a request out of the queues; free its cache unless the caller
        keeps it (a context worker holds finished prompts for a pull)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if free_blocks:
            self.manager.free(request.request_id, request.num_computed_tokens)

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_tokens
        # Each running request with its uncomputed tokens, decodes first.
        decodes: list[tuple[Request, int]] = []
        prefills: list[tuple[Request, int]] = []
        for r in self.running:
            uncomputed = r.num_uncomputed_tokens
            if uncomputed == 1:
                decodes.append((r, 1))
            elif uncomputed > 1:
                prefills.append((r, uncomputed))
        max_batch = self.config.max_batch_size
        for request, uncomputed in decodes + prefills:
            if request.status is not RequestStatus.RUNNING or budget == 0:
                continue  # preempted earlier in this step
            if len(out.sequences) >= max_batch:
                break
            budget -= self._schedule_running(request, uncomputed, budget, out)
        self._admit_waiting(budget, out)
        if out.sequences:
            out.copies = self.manager.take_copies()
        return out

    def _schedule_running(
        self, request: Request, uncomputed: int, budget: int, out: SchedulerOutput
    ) -> int:
        """Schedule a running request with `uncomputed` tokens to compute,
        preempting newer ones for blocks. Returns the budget spent (refunds
        for preempted victims included)."""
        if uncomputed == 1 and self.drafter is not None and budget > 1:
            verify = self._verify(request, budget)
            if verify is not None:
                out.sequences.append(verify)
                return verify.num_new_tokens
        num_new = self._chunk(request, min(uncomputed, budget))
        if not self._fits_ever(request, num_new):
            self.running.remove(request)
            self._fail(request, out)
            return 0
        spent = 0
        while not self._allocate(request, num_new):
            victim = self._victim()
            spent -= self._preempt(victim, out)
            if victim is request:
                return spent
        start = request.num_computed_tokens
        out.sequences.append(ScheduledSequence(request, num_new, start, num_new == uncomputed))
        return spent + num_new

    def _verify(self, request: Request, budget: int) -> ScheduledSequence | None:
        """The request's last token and its drafts as one verify chunk, when
        it has drafts and their blocks (and verify slots) are free; None to
        decode it as one token."""
        assert self.drafter is not None
        start = request.num_computed_tokens
        room = min(budget, self.config.max_model_tokens - start) - 1
        limit = self.manager.draft_limit(request.request_id, start, room)
        if limit <= 0:
            return None
        drafts = tuple(self.drafter.propose(request, limit))[:limit]
        if not drafts or not self._allocate(request, 1 + len(drafts)):
            return None
        slots = self.manager.take_verify_slots(request.request_id, len(drafts))
        if slots is None:
            return None
        return ScheduledSequence(request, 1 + len(drafts), start, True, drafts, slots)

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_batch_size:
            if len(out.sequences) >= self.config.max_batch_size:
                return
            request = self.waiting[0]
            if request.status is RequestStatus.WAITING and request.num_computed_tokens == 0:
                self._match_prefix(request)
            num_new = self._chunk(request, min(request.num_uncomputed_tokens, budget))
            if not self._fits_ever(request, num_new):
                self.waiting.popleft()
                self._fail(request, out)
                continue
            paced = len(self.waiting) <= PACED_BACKLOG
            if paced and not self.pacing.admits(out.num_prompt_tokens, num_new):
                return  # the next step takes it first
            if not self._allocate(request, num_new):
                # Wait for running requests (or pinned handoffs) to free blocks.
                return
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.sequences.append(ScheduledSequence.of(request, num_new))
            budget -= num_new

    def _match_prefix(self, request: Request) -> None:
        if not self.config.enable_prefix_match:
            return
        # The manager leaves at least the last token to compute: its logits
        # give the next token.
        cached = self.manager.match_prefix(
            request.request_id, request.all_token_ids, request.images
        )
        request.num_computed_tokens = cached
        request.num_cached_tokens = cached

    def _chunk(self, request: Request, num_new: int) -> int:
        """`num_new`, or fewer where the manager wants the chunk to end at a
        Mamba snapshot point."""
        return self.manager.chunk_limit(request.request_id, request.num_computed_tokens, num_new)

    def _allocate(self, request: Request, num_new: int) -> bool:
        total = request.num_computed_tokens + num_new
        # The tokens only name the blocks they fill, for reuse.
        tokens = request.token_ids_upto(total) if self.manager.enable_block_reuse else None
        return self.manager.allocate_slots(request.request_id, total, tokens, request.images)

    def _victim(self) -> Request:
        """The running request to preempt: the newest one this worker can
        compute again, else the newest of all."""
        recomputable = (r for r in reversed(self.running) if r.can_recompute)
        return next(recomputable, self.running[-1])

    def _preempt(self, victim: Request, out: SchedulerOutput) -> int:
        """Free the victim's cache and requeue it at the head of the waiting
        queue, or hand it back when it cannot be recomputed here. Returns the
        budget it had been given this step (0 if none)."""
        self.running.remove(victim)
        # Its chunk of this step (if any) never runs: only what ran is kept.
        self.manager.free(victim.request_id, victim.num_computed_tokens)
        self.manager.cancel_verify(victim.request_id)
        refund = 0
        for seq in out.sequences:
            if seq.request is victim:
                refund = seq.num_new_tokens
                out.sequences.remove(seq)
                break
        if not victim.can_recompute:
            victim.finish(FinishReason.PREEMPTED)
            out.handed_back.append(victim)
            return refund
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)
        return refund

    def _fits_ever(self, request: Request, num_new: int) -> bool:
        return request.num_computed_tokens + num_new <= self.config.max_model_tokens

    def _fail(self, request: Request, out: SchedulerOutput) -> None:
        self.manager.free(request.request_id)
        request.finish(
            FinishReason.ERROR,
            f"request {request.request_id!r} needs more than the {self.config.max_model_tokens} "
            f"tokens of KV cache this worker has in total; raise max_tokens or lower the "
            f"request's max_tokens",
        )
        out.failed.append(request)

    # ---- after the model ran ----------------------------------------------

    def commit(self, out: SchedulerOutput, accepted: Sequence[int | None] = ()) -> None:
        """Mark each scheduled chunk as computed (call once the forward ran
        and the sampled tokens were appended). `accepted[i]`, for a verify
        `out.sequences[i]`: how many of its drafts stay computed (its last
        token always does); all of them when not given."""
        for i, seq in enumerate(out.sequences):
            request = seq.request
            if not seq.drafts:
                request.num_computed_tokens += seq.num_new_tokens
                continue
            num = accepted[i] if i < len(accepted) else None
            num = len(seq.drafts) if num is None else num
            request.num_computed_tokens += 1 + num
            tokens = (
                request.token_ids_upto(request.num_computed_tokens)
                if self.manager.enable_block_reuse
                else None
            )
            self.manager.settle_verify(request.request_id, num, len(seq.drafts), tokens)
        self.manager.step_done()
