"""Turn a scheduled step into tensors, run the model, sample.

The runner owns the model and the cache views; the KV cache manager owns the
bookkeeping. Once per step it flattens the scheduled chunks into one
`ForwardBatch` (input ids, positions, block tables, slot mapping, Mamba
slots, logits indices), runs `model.forward` under `torch.inference_mode()`,
turns the last position of every sampling sequence into logits and samples.

A verify sequence (a token and its drafts, `engine.speculation`) samples at
every one of its positions, each as a plain decode would sample there, and
keeps its drafts up to the first that differs (`engine.speculation.verify`).
A seeded request's generator then stands where plain decoding would have
left it: one draw per token it kept.

With MTP drafting (`engine.speculation.mtp`) the runner then runs the
model's MTP layers over what the step kept and returns each sampling
request's drafts for its next step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from engine.decode_graphs import DecodeGraphs, build_decode_graphs
from engine.grammar import GrammarBook
from engine.image_encoder import ImageChunk, ImageEncoder, placeholder_rows
from engine.samples import forks_here, sample_id, sample_seed
from engine.scheduler import ScheduledSequence
from engine.speculation.mtp import KeptChunk, MTPDrafting
from engine.speculation.verify import num_accepted
from engine.step_event import HostEvent, StepEvent, StepSpan, finished_span, record_event
from engine.token_history import TokenHistory, history_for
from kvcache.snapshots import StateCopies
from kvcache.views import CacheViews
from models.batch import ForwardBatch
from models.host_batch import HostBatch

# Image placeholder rows of a step and their embeddings (`ImageEncoder.rows`).
Images = tuple[torch.Tensor, torch.Tensor]


class CacheAddressing(Protocol):
    """Where a request's cache lives (the KV cache manager's view)."""

    def block_table(self, request_id: str) -> Sequence[int]: ...

    def mamba_slot(self, request_id: str) -> int | None: ...


class CausalModel(Protocol):
    def forward(self, batch: ForwardBatch, caches: CacheViews) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class StepFollowers(Protocol):
    """The other ranks of a tensor-parallel instance (`engine.tensor_parallel.RankGroup`)."""

    def send(self, step: StepInput) -> None: ...

    def send_mtp(self, chunks: list[KeptChunk]) -> None:
        """The step's kept chunks, for the other ranks' MTP drafting."""

    def abandon(self) -> None:
        """Rank 0's step failed: the ranks are out of step for good."""


@dataclass(frozen=True)
class StepInput:
    """One step's batch, packed on the host (`models.host_batch.HostBatch`).

    What rank 0 of a tensor-parallel instance sends the other ranks each
    step: every rank builds the same `ForwardBatch` from it over its own
    cache, whose block ids and Mamba slots are rank 0's.
    """

    host: HostBatch
    # Rows that take image embeddings (VL models): rank 0 runs the image path
    # and the model shares the embeddings with the other ranks.
    image_rows: list[int] = field(default_factory=list)
    # Mamba snapshot loads before the forward and saves after it.
    copies: StateCopies = field(default_factory=StateCopies)

    def to_batch(self, device: torch.device) -> ForwardBatch:
        batch = self.host.to_device(device)
        if self.image_rows:
            batch.image_rows = torch.tensor(self.image_rows, dtype=torch.int64, device=device)
        return batch


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class StepTimings:
    """Seconds spent in each part of a step (for the per-step breakdown).

    `forward_s` (with MTP drafting) and `sample_s` are read from the step's
    events (`engine.step_event`), on a GPU device times. A GPU step that
    samples nothing returns while its kernels run: its `forward_s` is then
    only the time it took to launch them. `span` is the whole step's device
    work, which `PromptPacing` learns from once it is done.
    """

    build_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    span: StepSpan = field(default_factory=finished_span)


@dataclass
class RunnerOutput:
    # One entry per scheduled sequence, None where the chunk does not sample;
    # for a verify, the token after its accepted drafts.
    sampled: list[SampledToken | None] = field(default_factory=list)
    timings: StepTimings = field(default_factory=StepTimings)
    # Verifies only, by sequence index: the accepted drafts, as sampled
    # (with their logprobs), before `sampled[i]`.
    accepted: dict[int, list[SampledToken]] = field(default_factory=dict)
    # MTP drafting only, by sequence index: the drafts to verify after `sampled[i]`.
    drafts: dict[int, list[int]] = field(default_factory=dict)
    # n samples (`engine.samples`), by sequence index: the first tokens of
    # samples 1..n-1, from the same logits as `sampled[i]` (sample 0's).
    forks: dict[int, list[SampledToken]] = field(default_factory=dict)
    # Recorded after the step's last cache write: blocks it wrote may be
    # offered or published once this is done (`engine.step_event`).
    written: StepEvent = field(default_factory=HostEvent)


class ModelRunner:
    def __init__(
        self,
        model: CausalModel,
        caches: CacheViews,
        addressing: CacheAddressing,
        block_size: int,
        sampler: Any,
        device: str = "cpu",
        is_hybrid: bool = False,
        image_encoder: ImageEncoder | None = None,
        followers: StepFollowers | None = None,
        mtp: MTPDrafting | None = None,
        grammars: GrammarBook | None = None,
    ) -> None:
        self.model = model
        # Structured output: the grammar masks of constrained rows (`engine.grammar`).
        self.grammars = grammars
        # The model's MTP layers, run after each step for the next one's drafts.
        self.mtp = mtp
        # Tensor parallelism: every step (warm-up ones too) goes to the other
        # ranks first, whose shards join this one's collectives.
        self.followers = followers
        self.caches = caches
        self.addressing = addressing
        self.block_size = block_size
        self.sampler = sampler
        self.device = torch.device(device)
        self.is_hybrid = is_hybrid
        self.image_encoder = image_encoder
        # Per-request torch.Generator for seeded sampling; created lazily.
        self.generators: dict[str, torch.Generator | None] = {}
        # Per request with penalties: the tokens it has seen (`engine.token_history`).
        self.histories: dict[str, TokenHistory] = {}
        # Captured decode steps (CUDA only), set by `prepare`.
        self.graphs: DecodeGraphs | None = None
        # A follower's last step's hidden states, for its MTP drafting.
        self._followed: torch.Tensor | None = None
        # A seeded verify's generator state before its draws (`_rewind`).
        self._verify_states: dict[str, torch.Tensor] = {}
        # After the cache writes of the last step `follow` ran.
        self.written: StepEvent = HostEvent()

    def prepare(self, max_blocks_per_seq: int, graph_batch_sizes: Sequence[int] = ()) -> None:
        """Startup, before any request: run a decode step and a short prompt,
        so that the kernels of both are compiled now rather than in the first
        request (Triton's on CUDA; on CPU the C kernels, which are built on
        first use, the prefill attention one among them), and, on CUDA,
        capture decode graphs for `graph_batch_sizes` (see
        `engine.decode_graphs`; on CPU that is skipped with a log line).

        The warm-up steps write K/V only into the null block and, for hybrid
        models, Mamba slot 0, which no request holds yet and which is cleared
        when a request's prefill first takes it.
        """
        with torch.inference_mode():
            for width in sorted({1, max_blocks_per_seq}):
                self._run(self._warm_up_step(width))
            self._run(self._warm_up_prompt())
        self.graphs = build_decode_graphs(
            self.model,
            self.caches,
            batch_sizes=graph_batch_sizes,
            max_blocks=max_blocks_per_seq,
            block_size=self.block_size,
            device=self.device,
            is_hybrid=self.is_hybrid,
        )

    def _warm_up_step(self, width: int) -> StepInput:
        """One decode token at position 1 of a sequence held in the null block."""
        return StepInput(
            HostBatch.pack(
                input_ids=[0],
                positions=[1],
                query_start_loc=[0, 1],
                seq_lens=[2],
                context_lens=[1],
                block_tables=[[0] * width],
                slot_mapping=[1],
                block_size=self.block_size,
                mamba_slots=[0] if self.is_hybrid else None,
                logits_indices=[0],
            )
        )

    def _warm_up_prompt(self, length: int = 2) -> StepInput:
        """A prompt of `length` tokens held in the null block, its last one sampled."""
        bs = self.block_size
        return StepInput(
            HostBatch.pack(
                input_ids=[0] * length,
                positions=list(range(length)),
                query_start_loc=[0, length],
                seq_lens=[length],
                context_lens=[0],
                block_tables=[[0] * -(-length // bs)],
                slot_mapping=[p % bs for p in range(length)],
                block_size=bs,
                mamba_slots=[0] if self.is_hybrid else None,
                logits_indices=[length - 1],
            )
        )

    def build_batch(self, seqs: Sequence[ScheduledSequence]) -> ForwardBatch:
        """Flatten the step's chunks into one batch (one host-to-device copy);
        see `models/batch.py`."""
        return self._batch(*self.describe(seqs))

    def describe(self, seqs: Sequence[ScheduledSequence]) -> tuple[StepInput, list[ImageChunk]]:
        """The step's chunks flattened and packed on the host, and where its images go."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[Sequence[int]] = []
        mamba_slots: list[int] = []
        logits_indices: list[int] = []
        image_chunks: list[ImageChunk] = []
        verify_slots: list[tuple[int, ...]] = []
        bs = self.block_size
        for seq in seqs:
            req = seq.request
            start, end = seq.start, seq.start + seq.num_new_tokens
            if req.images:
                image_chunks.append(ImageChunk(req.images, start, end, len(input_ids)))
            table = self.addressing.block_table(req.request_id)
            if end - start == 1:  # a decode token: most rows of most steps
                input_ids.append(req.token_at(start))
                positions.append(start)
                slot_mapping.append(table[start // bs] * bs + start % bs)
            elif seq.drafts:  # a verify: the last token, then its drafts
                input_ids.append(req.token_at(start))
                input_ids.extend(seq.drafts)
                positions.extend(range(start, end))
                slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
                logits_indices.extend(range(len(input_ids) - end + start, len(input_ids) - 1))
            else:
                input_ids.extend(req.token_ids_between(start, end))
                positions.extend(range(start, end))
                slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            context_lens.append(start)
            tables.append(table)
            if self.is_hybrid:
                mamba_slots.append(_require_slot(self.addressing, req.request_id))
                verify_slots.append(seq.verify_slots)
            if seq.samples:
                logits_indices.append(len(input_ids) - 1)
        step = StepInput(
            HostBatch.pack(
                input_ids=input_ids,
                positions=positions,
                query_start_loc=query_start_loc,
                seq_lens=seq_lens,
                context_lens=context_lens,
                block_tables=tables,
                slot_mapping=slot_mapping,
                block_size=bs,
                mamba_slots=mamba_slots if self.is_hybrid else None,
                logits_indices=logits_indices,
                verify_slots=verify_slots if any(verify_slots) else (),
            )
        )
        return step, image_chunks

    def _batch(self, step: StepInput, image_chunks: Sequence[ImageChunk] = ()) -> ForwardBatch:
        return self._with_images(step.to_batch(self.device), self._images(image_chunks))

    def _images(self, image_chunks: Sequence[ImageChunk]) -> Images | None:
        if not image_chunks or self.image_encoder is None:
            return None
        return self.image_encoder.rows(list(image_chunks))

    @staticmethod
    def _with_images(batch: ForwardBatch, images: Images | None) -> ForwardBatch:
        if images is not None:
            batch.image_rows, batch.image_embeds = images
        return batch

    def execute(
        self, seqs: Sequence[ScheduledSequence], copies: StateCopies | None = None
    ) -> RunnerOutput:
        """Run one step (with its snapshot `copies`); return the sampled token
        of every sampling sequence."""
        timings = StepTimings()
        t0 = time.perf_counter()
        step, image_chunks = self.describe(seqs)
        if copies:
            step = replace(step, copies=copies)
        t1 = time.perf_counter()
        start = record_event(self.device)
        with torch.inference_mode():
            hidden, logits = self._run(step, image_chunks)
            forward_end = record_event(self.device)
            t2 = time.perf_counter()
            sampling = [s for s in seqs if s.samples]
            tokens = self._sample(logits, sampling) if logits is not None else []
        out = self._verified(seqs, tokens, timings)
        sampled = record_event(self.device)
        timings.build_s = t1 - t0
        if self.mtp is not None:
            with torch.inference_mode():
                chunks = self._kept_chunks(seqs, step, out)
                out.drafts = self._draft(chunks, hidden)
        out.written = record_event(self.device)
        timings.span = StepSpan(start, out.written)
        if tokens:
            # The host has read this step's tokens (and drafts): its work is
            # done but for the events, so this waits for them alone.
            out.written.wait()
        if timings.span.done():
            timings.forward_s = forward_end.seconds_since(start)
            timings.forward_s += out.written.seconds_since(sampled)
            timings.sample_s = sampled.seconds_since(forward_end)
        else:
            timings.forward_s = t2 - t1  # launched, still running
        return out

    def _verified(
        self,
        seqs: Sequence[ScheduledSequence],
        tokens: Sequence[SampledToken],
        timings: StepTimings,
    ) -> RunnerOutput:
        """Each sequence's sampled token, and a verify's accepted drafts."""
        out = RunnerOutput(timings=timings)
        it = iter(tokens)
        for i, seq in enumerate(seqs):
            if not seq.samples:
                out.sampled.append(None)
                continue
            if not seq.drafts:
                out.sampled.append(next(it))
                if forks_here(seq.request):
                    out.forks[i] = [next(it) for _ in range(seq.request.params.n - 1)]
                continue
            rows = [next(it) for _ in range(len(seq.drafts) + 1)]
            kept = num_accepted(seq.drafts, [row.token_id for row in rows])
            self._rewind(seq.request, len(rows), kept + 1)
            out.accepted[i] = rows[:kept]
            out.sampled.append(rows[kept])
        return out

    def _kept_chunks(
        self, seqs: Sequence[ScheduledSequence], step: StepInput, out: RunnerOutput
    ) -> list[KeptChunk]:
        """What each chunk keeps, with the token after each of its kept
        positions (`engine.speculation.mtp`). Requests with penalties never
        draft, so their MTP cache is never read and is not kept."""
        chunks = []
        row_starts = step.host.shape.query_start_loc
        for i, seq in enumerate(seqs):
            req = seq.request
            if req.params.has_penalties:
                continue
            start, end = seq.start, seq.start + seq.num_new_tokens
            sampled = out.sampled[i]
            if sampled is None:  # a prefill chunk short of the prompt's end
                after = req.token_ids_between(start + 1, end + 1)
            elif seq.drafts:
                accepted = [t.token_id for t in out.accepted[i]]
                after = [*accepted, sampled.token_id]
            else:
                after = [*req.token_ids_between(start + 1, end), sampled.token_id]
            table = self.addressing.block_table(req.request_id)
            chunks.append(
                KeptChunk(
                    i,
                    req.request_id,
                    start,
                    tuple(after),
                    row_starts[i],
                    table,
                    sampled is not None,
                )
            )
        return chunks

    def _rewind(self, request: Any, drawn: int, used: int) -> None:
        """A seeded sampled request drew `drawn` values for the rows of its
        verify and keeps `used` tokens: leave its generator as `used` plain
        steps would have (one `draw_uniform` per row)."""
        from engine.sampling import draw_uniform

        state = self._verify_states.pop(request.request_id, None)
        generator = self.generators.get(request.request_id)
        if state is None or generator is None or used == drawn:
            return
        generator.set_state(state)
        for _ in range(used):
            draw_uniform(generator)

    def _draft(self, chunks: list[KeptChunk], hidden: torch.Tensor) -> dict[int, list[int]]:
        """MTP drafting, on every rank: the other ranks get the kept chunks
        first and run the same drafting on their shards (`follow_mtp`)."""
        assert self.mtp is not None
        if self.followers is None or not any(c.next_tokens for c in chunks):
            return self.mtp.draft(chunks, hidden, self.caches)
        self.followers.send_mtp(chunks)
        try:
            return self.mtp.draft(chunks, hidden, self.caches)
        except BaseException:
            self.followers.abandon()
            raise

    def follow(self, step: StepInput) -> None:
        """Run rank 0's `step` on this rank's shard (ranks 1.. of a
        tensor-parallel instance); the logits are rank 0's to sample.
        `written` marks the end of its cache writes. With MTP the step's
        hidden states wait for the step's kept chunks (`follow_mtp`)."""
        with torch.inference_mode():
            hidden, _ = self._run(step)
        self._followed = hidden if self.mtp is not None else None
        self.written = record_event(self.device)

    def follow_mtp(self, chunks: list[KeptChunk]) -> None:
        """Rank 0's MTP drafting of the step `follow` last ran, on this rank's
        shard of the MTP layers (its drafts are rank 0's too, and dropped)."""
        assert self.mtp is not None and self._followed is not None
        with torch.inference_mode():
            self.mtp.draft(chunks, self._followed, self.caches)
        self._followed = None
        self.written = record_event(self.device)

    def _run(
        self, step: StepInput, image_chunks: Sequence[ImageChunk] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward: the hidden states, and the logits of the sampling rows
        (None if there are none)."""
        images = self._images(image_chunks)
        if self.followers is None:
            return self._forward(step, images)
        if images is not None:
            # The other ranks learn which rows are images; the model hands
            # them the embeddings (the image path runs here alone).
            step = replace(step, image_rows=placeholder_rows(image_chunks))
        self.followers.send(step)
        try:
            return self._forward(step, images)
        except BaseException:
            self.followers.abandon()
            raise

    def _forward(
        self, step: StepInput, images: Images | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch = self._with_images(step.to_batch(self.device), images)
        if step.copies:
            self.caches.apply_loads(step.copies)
        hidden = self.graphs.run(batch) if self.graphs is not None else None
        if hidden is None:
            hidden = self.model.forward(batch, self.caches)
        if step.copies:
            self.caches.apply_saves(step.copies)
        if not step.host.num_logits:
            return hidden, None
        assert batch.logits_indices is not None
        return hidden, self.model.compute_logits(hidden[batch.logits_indices])

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        """The request's sampling generator, made on first use (None unseeded)."""
        from engine.sampling import make_generator

        if request_id not in self.generators:
            self.generators[request_id] = (
                make_generator(seed, self.device) if seed is not None else None
            )
        return self.generators[request_id]

    def release(self, request_id: str) -> None:
        """Forget per-request sampling state (its seeded generator, its token history)."""
        self.generators.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.release(request_id)
        self._verify_states.pop(request_id, None)
        self.histories.pop(request_id, None)

    def _sample(
        self, logits: torch.Tensor, seqs: Sequence[ScheduledSequence]
    ) -> list[SampledToken]:
        reqs: list[Any] = []
        generators = []
        prefixes: list[tuple[int, ...]] = []  # each row's drafts before it
        forking = False
        for seq in seqs:
            req = seq.request
            generator = self._generator(req.request_id, getattr(req.params, "seed", None))
            rows = 1 + len(seq.drafts)
            if seq.drafts and generator is not None and not req.params.is_greedy:
                self._verify_states[req.request_id] = generator.get_state()
            reqs.extend([req] * rows)
            generators.extend([generator] * rows)
            prefixes.extend(tuple(seq.drafts[:j]) for j in range(rows))
            if not seq.drafts and forks_here(req):
                # Samples 1..n-1 draw their first tokens from this row too,
                # each from its own generator (`engine.samples`).
                for index in range(1, req.params.n):
                    seed = sample_seed(req.params.seed, index)
                    generators.append(self._generator(sample_id(req.request_id, index), seed))
                reqs.extend([req] * (req.params.n - 1))
                prefixes.extend([()] * (req.params.n - 1))
                forking = True
        if forking:
            logits = logits[torch.tensor(_logit_rows(seqs), device=logits.device)]
        vocab = logits.shape[-1]
        histories = [
            history_for(self.histories, r.request_id, r.prompt_token_ids, r.output_token_ids, vocab)
            if r.params.has_penalties
            else None
            for r in reqs
        ]
        logits = logits.float()
        if self.grammars is not None:
            logits = self.grammars.mask(logits, reqs, prefixes)
        out = self.sampler.sample(logits, [r.params for r in reqs], histories, generators)
        return [
            SampledToken(
                token_id=int(out.token_ids[i]),
                logprob=None if out.logprobs[i] is None else float(out.logprobs[i]),
                top_logprobs=out.top_logprobs[i],
            )
            for i in range(len(reqs))
        ]


def _logit_rows(seqs: Sequence[ScheduledSequence]) -> list[int]:
    """The logits row of each sampled row: a forking sequence's row n times."""
    rows: list[int] = []
    logit = 0
    for seq in seqs:
        if not seq.drafts and forks_here(seq.request):
            rows.extend([logit] * seq.request.params.n)
            logit += 1
        else:
            width = 1 + len(seq.drafts)
            rows.extend(range(logit, logit + width))
            logit += width
    return rows


def _require_slot(addressing: CacheAddressing, request_id: str) -> int:
    slot = addressing.mamba_slot(request_id)
    if slot is None:
        raise RuntimeError(
            f"request {request_id!r} runs on a hybrid model but holds no Mamba state slot"
        )
    return slot
