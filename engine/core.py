"""The engine step every worker kind runs: schedule, run the model, update.

`EngineCore` is synchronous and single-threaded; the worker actors drive it
from an asyncio loop (see `engine/loop.py`). Roles differ only at the finish
line:

- generation / aggregated: a request runs until a stop condition, then its
  cache is freed;
- context: a request stops after its first token with `FinishReason.HANDOFF`
  and its blocks (and Mamba slot) stay allocated for the generation side to
  pull; the worker frees them on release or lease expiry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engine.grammar import GrammarError
from engine.messages import EventItem, StepTokens, TokenEvent
from engine.model_runner import ModelRunner, RunnerOutput, SampledToken, StepTimings
from engine.request import FinishReason, Request
from engine.samples import SampleFamilies, SampleStart, finish_value, sample_id, sample_request
from engine.scheduler import Scheduler, SchedulerOutput
from engine.speculation.drafts import Drafter
from engine.step_event import HostEvent, PacedReadings, StepEvent

# Decides whether a request must stop after its newest token; returns the
# reason or None. Built per request by the worker (EOS, stop tokens, stop
# strings, max_tokens).
StopCheck = Callable[[Request], FinishReason | None]


@dataclass
class StepPlan:
    """A scheduled step: what the model computes, and the result so far
    (requests that failed or were handed back while scheduling)."""

    sched: SchedulerOutput
    result: StepResult

    @property
    def is_empty(self) -> bool:
        return self.sched.is_empty


@dataclass
class StepResult:
    events: list[TokenEvent] = field(default_factory=list)
    tokens: StepTokens | None = None  # the plain new tokens, as columns
    finished: list[Request] = field(default_factory=list)
    # Context role: requests whose cache now waits for a pull (still allocated).
    handoffs: list[Request] = field(default_factory=list)
    # Requests that ran a prefill chunk short of their last token this step
    # (their leading full blocks are final), and requests preempted by it.
    prefilling: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_tokens: int = 0
    num_seqs: int = 0  # sequences the step computed
    num_preempted: int = 0
    num_handed_back: int = 0  # preempted, and ended here to resume elsewhere
    schedule_s: float = 0.0
    timings: StepTimings = field(default_factory=StepTimings)
    # After the step's last cache write: what it wrote is exposed once this
    # is done (`engine.step_event`).
    written: StepEvent = field(default_factory=HostEvent)

    def outgoing(self) -> list[EventItem]:
        """What the step sends its requests' streams, in order (a request
        has one token at most in a step, so the plain ones go first)."""
        if not self.tokens:
            return list(self.events)
        return [self.tokens, *self.events]


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        make_stop_check: Callable[[Request], StopCheck],
        context_only: bool = False,
        drafter: Drafter | None = None,
    ) -> None:
        self.scheduler = scheduler
        # Speculative decoding: the scheduler asks it for drafts, the verify
        # outcomes go back to it (`engine.speculation.drafts`).
        self.drafter = drafter
        self.runner = runner
        self.make_stop_check = make_stop_check
        self.context_only = context_only
        self.requests: dict[str, Request] = {}
        self._stop_checks: dict[str, StopCheck] = {}
        # n samples (`engine.samples`): each request's running samples, and
        # the samples the step being updated forks once it is committed.
        self.families = SampleFamilies()
        self._forks: list[tuple[Request, Request]] = []
        # Steps' timings for the scheduler's pacing, each once its device work is done.
        self._paced = PacedReadings(scheduler.pacing.observe)

    def add(self, request: Request) -> None:
        """Queue a request for prefill (raises `CapacityError` if it can never
        fit, `GrammarError` if its grammar does not compile)."""
        self._admit_grammar(request)
        self._register(request)
        try:
            self.scheduler.add(request)
        except Exception:
            self._forget(request.request_id)
            raise

    def add_prefilled(self, request: Request) -> None:
        """Admit a request whose first `num_computed_tokens` already sit in its
        allocated cache (pulled from a context worker); a grammar that does
        not compile frees that cache and raises `GrammarError`."""
        try:
            self._admit_grammar(request)
        except Exception:
            self.free_cache(request.request_id)
            raise
        self._register(request)
        self.scheduler.add_running(request)
        if request.sample_starts:
            self._fork_pulled(request)

    def _admit_grammar(self, request: Request) -> None:
        if self.runner.grammars is not None:
            self.runner.grammars.admit(request)
        elif request.params.grammar is not None:
            raise GrammarError("this engine was built without structured output")

    def abort(self, request_id: str) -> Request | None:
        """Drop a request (every sample of it) and free its cache; None if
        it is not here."""
        found = None
        members = self.families.members(request_id)
        self.families.forget(request_id)
        for member in members:
            request = self.requests.get(member)
            if request is None:
                continue
            self.scheduler.remove(request, free_blocks=True)
            request.finish(FinishReason.ABORT)
            self._forget(member)
            found = found or request
        return found

    def free_cache(self, request_id: str) -> None:
        """Free the blocks and slot allocated under `request_id` for a request
        that never joined (a pulled cache that could not be admitted)."""
        self.scheduler.manager.free(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> StepResult:
        """One engine iteration. Returns an empty result when nothing can run."""
        plan = self.schedule()
        if plan.is_empty:
            return plan.result
        return self.update(plan, self.execute(plan))

    # A step in three calls, for a driver that runs the model on another
    # thread (`engine.loop`): `schedule` and `update` change the scheduler
    # and the cache manager; `execute` reads only the scheduled requests (their
    # tokens, blocks and slots) and writes only their blocks and slots.

    def schedule(self) -> StepPlan:
        """Choose the step's chunks (allocating their blocks, preempting)."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        result = StepResult(
            num_tokens=sched.num_tokens,
            num_seqs=len(sched.sequences),
            num_preempted=len(sched.preempted),
            num_handed_back=len(sched.handed_back),
            schedule_s=time.perf_counter() - t0,
            preempted=list(sched.preempted),
        )
        for ended in (*sched.failed, *sched.handed_back):
            result.events.append(self._final_event(ended, []))
            result.finished.append(ended)
            self._forget(ended.request_id)
        return StepPlan(sched, result)

    def execute(self, plan: StepPlan) -> RunnerOutput:
        """Run the model on a non-empty plan."""
        return self.runner.execute(plan.sched.sequences, plan.sched.copies)

    def update(self, plan: StepPlan, runner_out: RunnerOutput) -> StepResult:
        """Apply the sampled tokens: advance, stop and free finished requests."""
        sched, result = plan.sched, plan.result
        timings = result.timings = runner_out.timings
        result.written = runner_out.written
        ended, kept = self._apply_samples(sched, runner_out, result)
        self.scheduler.commit(sched, kept)
        forks, self._forks = self._forks, []
        for parent, child in forks:  # before a parent that ended frees its blocks
            self._fork(parent, child, result)
        for request, reason in ended:
            request.finish(reason)
            keep = reason is FinishReason.HANDOFF
            self.scheduler.remove(request, free_blocks=not keep)
            (result.handoffs if keep else result.finished).append(request)
            self._forget(request.request_id)
        self._paced.add(sched.num_tokens, sched.num_prompt_tokens, timings.build_s, timings.span)
        result.prefilling = [seq.request for seq in sched.sequences if not seq.samples]
        return result

    def _apply_samples(
        self, sched: SchedulerOutput, runner_out: RunnerOutput, result: StepResult
    ) -> tuple[list[tuple[Request, FinishReason]], list[int | None]]:
        """Append each sequence's new tokens, stopping where a request stops,
        and build the step's events. Returns the requests that end, with
        why, and per verify the drafts that stay computed (`Scheduler.commit`)."""
        plain = StepTokens(time.time())  # the step's tokens were sampled together
        ids, token_ids = plain.request_ids, plain.token_ids
        prompt_lens, cached = plain.num_prompt_tokens, plain.num_cached_tokens
        events = result.events
        ended: list[tuple[Request, FinishReason]] = []
        kept: list[int | None] = []
        accepted = runner_out.accepted
        for i, (seq, token) in enumerate(zip(sched.sequences, runner_out.sampled, strict=True)):
            kept.append(None)
            if token is None:
                continue
            request = seq.request
            request.drafts = tuple(runner_out.drafts.get(i, ()))
            want = _wants_logprobs(request.params)
            drafts = accepted.get(i)
            if drafts is not None:
                num, reason = self._append_all(request, [*drafts, token], want)
                kept[i] = num - 1
                if self.drafter is not None:
                    self.drafter.record(request.request_id, len(seq.drafts), len(drafts))
                if reason is None and self.context_only:
                    reason = FinishReason.HANDOFF
                events.append(self._token_event(request, reason, want, plain.timestamp, num))
                if reason is not None:
                    ended.append((request, reason))
                continue
            self._append(request, token, want)
            reason = self._stop_checks[request.request_id](request)
            forks = runner_out.forks.get(i)
            if forks is not None:
                reason = self._samples_started(request, reason, forks, events, plain.timestamp)
            if reason is None and self.context_only:
                reason = FinishReason.HANDOFF
            if reason is None and not want:
                ids.append(request.stream_id)
                plain.samples.append(request.sample_index)
                token_ids.append(token.token_id)
                prompt_lens.append(len(request.prompt_token_ids))
                cached.append(request.num_cached_tokens)
                continue
            events.append(self._token_event(request, reason, want, plain.timestamp))
            if reason is not None:
                ended.append((request, reason))
        if plain:
            result.tokens = plain
        return ended, kept

    def _samples_started(
        self,
        parent: Request,
        reason: FinishReason | None,
        forks: Sequence[SampledToken],
        events: list[TokenEvent],
        sampled_at: float,
    ) -> FinishReason | None:
        """`parent`'s prefill sampled the first tokens of its samples 1..n-1
        (`forks`): record every sample's start; a context worker hands the
        cache off while any sample runs on, elsewhere the running samples
        fork once the step is committed. Returns why `parent` ends here."""
        logprob = parent.output_logprobs[-1] if parent.output_logprobs else None
        top = parent.output_top_logprobs[-1] if parent.output_top_logprobs else None
        first = parent.output_token_ids[-1]
        starts = [SampleStart(0, first, logprob, top, finish_value(reason))]
        children: list[tuple[Request, FinishReason | None]] = []
        for index, token in enumerate(forks, start=1):
            start = SampleStart(index, token.token_id, token.logprob, token.top_logprobs)
            child = sample_request(parent, start)
            child_reason = self.make_stop_check(child)(child)
            starts.append(replace(start, finish_reason=finish_value(child_reason)))
            children.append((child, child_reason))
        parent.sample_starts = tuple(starts)
        if self.context_only:
            return FinishReason.HANDOFF if any(not s.finished for s in starts) else reason
        self.families.open(
            parent.request_id, [sample_id(parent.request_id, s.index) for s in starts]
        )
        want = _wants_logprobs(parent.params)
        for child, child_reason in children:
            events.append(self._token_event(child, child_reason, want, sampled_at))
            if child_reason is None:
                self._forks.append((parent, child))
        return reason

    def _fork_pulled(self, parent: Request) -> None:
        """A pulled request of n samples (its first tokens came from the
        context worker): fork the samples that run on; sample 0 leaves at
        once when it ended there (its stream already has its last token)."""
        running = [s for s in parent.sample_starts if not s.finished]
        self.families.open(
            parent.request_id, [sample_id(parent.request_id, s.index) for s in running]
        )
        for start in running:
            if start.index:
                self._fork(parent, sample_request(parent, start), None)
        if parent.sample_starts[0].finished:
            self.scheduler.remove(parent, free_blocks=True)
            parent.finish(FinishReason.STOP)
            self._forget(parent.request_id)

    def _fork(self, parent: Request, child: Request, result: StepResult | None) -> None:
        """Start sample `child` on `parent`'s computed cache (shared blocks and
        copies); without a free block or slot for it, it waits to prefill
        the prompt again."""
        self._register(child)
        num = parent.num_computed_tokens
        if self.scheduler.manager.fork(parent.request_id, child.request_id, num):
            child.num_computed_tokens = num
            self.scheduler.add_running(child)
            return
        try:
            self.scheduler.add(child)
        except Exception as exc:  # the queue is full: the sample cannot run here
            child.finish(FinishReason.ERROR, str(exc))
            event = self._final_event(child, [])
            self._forget(child.request_id)
            if result is not None:
                result.events.append(event)

    def _append_all(
        self, request: Request, tokens: Sequence[SampledToken], want_logprobs: bool
    ) -> tuple[int, FinishReason | None]:
        """Append a verify's tokens one by one until the request stops.
        Returns how many it kept and the reason it stops (None: it runs on)."""
        stop_check = self._stop_checks[request.request_id]
        for num, token in enumerate(tokens, start=1):
            self._append(request, token, want_logprobs)
            reason = stop_check(request)
            if reason is not None:
                return num, reason
        return len(tokens), None

    @staticmethod
    def _append(request: Request, token: SampledToken, want_logprobs: bool) -> None:
        if want_logprobs:
            request.append_output(token.token_id, token.logprob, token.top_logprobs)
        else:
            request.append_output(token.token_id)

    def _token_event(
        self,
        request: Request,
        reason: FinishReason | None,
        want_logprobs: bool,
        sampled_at: float,
        num_tokens: int = 1,
    ) -> TokenEvent:
        """The event of `request`'s newest `num_tokens` tokens (and their
        logprobs when it asked for them)."""
        logprobs, top = request.output_logprobs, request.output_top_logprobs
        n = num_tokens
        handoff = reason is FinishReason.HANDOFF
        ends_stream = reason is None or handoff or self.families.end(request)
        return TokenEvent(
            request_id=request.stream_id,
            token_ids=request.output_token_ids[-n:],
            logprobs=logprobs[-n:] if want_logprobs and logprobs else None,
            top_logprobs=top[-n:] if want_logprobs and top else None,
            finish_reason=reason.value if reason is not None and ends_stream else None,
            sample=request.sample_index,
            sample_finish_reason=None if ends_stream else finish_value(reason),
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=request.num_cached_tokens,
            timestamp=sampled_at,
            draft_token_ids=list(request.drafts) if handoff else [],
        )

    def _final_event(self, request: Request, token_ids: list[int]) -> TokenEvent:
        reason = request.finish_reason or FinishReason.ERROR
        ends_stream = self.families.end(request)
        return TokenEvent(
            request_id=request.stream_id,
            token_ids=token_ids,
            finish_reason=reason.value if ends_stream else None,
            error=request.error,
            num_prompt_tokens=request.num_prompt_tokens,
            sample=request.sample_index,
            sample_finish_reason=None if ends_stream else reason.value,
        )

    def _register(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight here")
        self.requests[request.request_id] = request
        self._stop_checks[request.request_id] = self.make_stop_check(request)

    def _forget(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        self._stop_checks.pop(request_id, None)
        self.runner.release(request_id)
        if self.context_only and request is not None and request.sample_starts:
            for start in request.sample_starts[1:]:  # their generators drew here only
                self.runner.release(sample_id(request_id, start.index))
        if self.drafter is not None:
            self.drafter.forget(request_id)


def _wants_logprobs(params: Any) -> bool:
    return getattr(params, "logprobs", None) is not None
