"""Drive any `CausalLM` through paged prefill / chunked prefill / decode steps.

Builds real cache tensors from a `CacheSpec` (V1 layer-major or V2 block-major
pools, handed to the model as strided views), a trivial block allocator that
interleaves sequences so block tables are non-contiguous, and one
`ForwardBatch` per step. Each step every sequence still in its prompt feeds its
next chunk of at most `chunk_size` tokens, and every sequence past its prompt
feeds its greedy token, so steps mix prefill chunks with decode tokens once
prompts of different lengths are batched.

    trace = run_paged_generation(model, config.cache_spec(), [[1, 2, 3], [4, 5]],
                                 chunk_size=2, decode_steps=8, block_size=4)
    trace.prompt_logits[i]   # [len(prompt_i), vocab]: logits at every prompt position
    trace.decode_logits[i]   # [decode_steps, vocab]: logits that chose each new token
    trace.generated[i]       # greedy tokens: argmax of prompt_logits[-1], then of each decode row
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcache.pool_layout import BlockMajorLayout, LayerMajorLayout, layout_for
from kvcache.spec import CacheSpec
from kvcache.tensors import allocate_cache_tensors
from kvcache.views import CacheViews
from models.base import CausalLM
from models.batch import ForwardBatch

NULL_BLOCK = 0


def build_cache_views(
    spec: CacheSpec, num_blocks: int, block_size: int, num_slots: int, block_major: bool = False
) -> CacheViews:
    """Zeroed caches for `spec` in the manager's own pools (V2 block-major or
    V1 layer-major, head-outer blocks); attention views are strided windows."""
    manager = BlockMajorLayout.manager if block_major else LayerMajorLayout.manager
    layout = layout_for(manager, spec, block_size, num_blocks, num_slots)
    return allocate_cache_tensors(layout).views()


def _long(values: list[int] | list[list[int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@dataclass
class _Sequence:
    prompt: list[int]
    slot: int
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # prompt + generated, fed or pending
    num_computed: int = 0
    prompt_logits: list[torch.Tensor] = field(default_factory=list)
    decode_logits: list[torch.Tensor] = field(default_factory=list)
    # Prompt positions whose embedding replaces their token's (image placeholders).
    embeds_at: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class GenerationTrace:
    prompt_logits: list[torch.Tensor]
    decode_logits: list[torch.Tensor]
    generated: list[list[int]]
    num_steps: int


class PagedHarness:
    """Owns the caches and block tables of a small batch of sequences."""

    def __init__(
        self,
        model: CausalLM,
        spec: CacheSpec,
        block_size: int = 4,
        num_blocks: int = 128,
        max_seqs: int = 8,
        block_major: bool = False,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Slot 0 stays unused so a model that ignores `mamba_slots` reads the wrong state.
        self.caches = build_cache_views(spec, num_blocks, block_size, max_seqs + 1, block_major)
        self.next_block = NULL_BLOCK + 1
        self.sequences: list[_Sequence] = []

    def add(self, prompt: list[int], embeds_at: dict[int, torch.Tensor] | None = None) -> int:
        self.sequences.append(
            _Sequence(prompt=list(prompt), slot=len(self.sequences) + 1, embeds_at=embeds_at or {})
        )
        self.sequences[-1].tokens = list(prompt)
        return len(self.sequences) - 1

    def _reserve(self, seq: _Sequence, total_tokens: int) -> None:
        while len(seq.blocks) * self.block_size < total_tokens:
            if self.next_block >= self.num_blocks:
                raise RuntimeError(f"harness pool of {self.num_blocks} blocks is exhausted")
            seq.blocks.append(self.next_block)
            self.next_block += 1

    def build_batch(self, feeds: list[tuple[_Sequence, list[int]]]) -> ForwardBatch:
        ids, positions, slots, starts = [], [], [], [0]
        context_lens, seq_lens = [], []
        image_rows: list[int] = []
        image_embeds: list[torch.Tensor] = []
        for seq, tokens in feeds:
            ctx = seq.num_computed
            self._reserve(seq, ctx + len(tokens))
            for pos in range(ctx, ctx + len(tokens)):
                if pos in seq.embeds_at:
                    image_rows.append(len(ids) + pos - ctx)
                    image_embeds.append(seq.embeds_at[pos])
            ids += tokens
            for pos in range(ctx, ctx + len(tokens)):
                block = seq.blocks[pos // self.block_size]
                positions.append(pos)
                slots.append(block * self.block_size + pos % self.block_size)
            starts.append(starts[-1] + len(tokens))
            context_lens.append(ctx)
            seq_lens.append(ctx + len(tokens))
        width = max(len(seq.blocks) for seq, _ in feeds)
        tables = [seq.blocks + [NULL_BLOCK] * (width - len(seq.blocks)) for seq, _ in feeds]
        return ForwardBatch(
            input_ids=_long(ids),
            positions=_long(positions),
            query_start_loc=_long(starts),
            seq_lens=_long(seq_lens),
            context_lens=_long(context_lens),
            block_tables=_long(tables),
            slot_mapping=_long(slots),
            block_size=self.block_size,
            mamba_slots=_long([seq.slot for seq, _ in feeds]),
            image_rows=_long(image_rows) if image_rows else None,
            image_embeds=torch.stack(image_embeds) if image_embeds else None,
        )

    @torch.no_grad()
    def step(self, chunk_size: int, max_new_tokens: int) -> bool:
        """Run one mixed step; False when every sequence is finished."""
        feeds: list[tuple[_Sequence, list[int]]] = []
        for seq in self.sequences:
            pending = seq.tokens[seq.num_computed :]
            in_prompt = seq.num_computed < len(seq.prompt)
            if in_prompt:
                feeds.append((seq, pending[:chunk_size]))
            elif len(seq.decode_logits) < max_new_tokens - 1 and pending:
                feeds.append((seq, pending))
        if not feeds:
            return False
        batch = self.build_batch(feeds)
        logits = self.model.compute_logits(self.model(batch, self.caches)).float()
        starts = batch.query_start_loc.tolist()
        for i, (seq, tokens) in enumerate(feeds):
            rows = logits[starts[i] : starts[i + 1]]
            if seq.num_computed < len(seq.prompt):
                seq.prompt_logits.append(rows)
            else:
                seq.decode_logits.append(rows[-1])
            seq.num_computed += len(tokens)
            if seq.num_computed == len(seq.tokens):
                seq.tokens.append(int(rows[-1].argmax()))
        return True


def run_paged_generation(
    model: CausalLM,
    spec: CacheSpec,
    prompts: list[list[int]],
    chunk_size: int,
    decode_steps: int,
    block_size: int = 4,
    block_major: bool = False,
    embeds_at: list[dict[int, torch.Tensor]] | None = None,
) -> GenerationTrace:
    """Prefill `prompts` in chunks and decode `decode_steps` greedy tokens each.

    `decode_logits[i]` has `decode_steps` rows: row j is the logits that chose
    generated token j + 1 (token 0 comes from the last prompt row).
    `embeds_at[i]` maps prompt positions of sequence i to the embeddings that
    replace their tokens' (image placeholders).
    """
    harness = PagedHarness(
        model, spec, block_size=block_size, max_seqs=len(prompts), block_major=block_major
    )
    for i, prompt in enumerate(prompts):
        harness.add(prompt, embeds_at[i] if embeds_at else None)
    num_steps = 0
    while harness.step(chunk_size, decode_steps + 1):
        num_steps += 1
    return GenerationTrace(
        prompt_logits=[torch.cat(s.prompt_logits) for s in harness.sequences],
        decode_logits=[torch.stack(s.decode_logits) for s in harness.sequences],
        generated=[s.tokens[len(s.prompt) :] for s in harness.sequences],
        num_steps=num_steps,
    )


# Parity bound: max |ours - reference| relative to the largest reference logit.
PARITY_TOLERANCE = 1e-4


def assert_matches_reference(
    reference: torch.nn.Module,
    prompts: list[list[int]],
    trace: GenerationTrace,
    decode_steps: int,
    reference_inputs: list[dict[str, torch.Tensor]] | None = None,
) -> None:
    """Prompt and decode logits within `PARITY_TOLERANCE` of `reference`'s own
    forward over each whole sequence, and the same greedy tokens.
    `reference_inputs[i]` adds keyword inputs for sequence i (its images)."""
    for i, prompt in enumerate(prompts):
        generated = trace.generated[i]
        assert len(generated) == decode_steps + 1
        full = torch.tensor([prompt + generated[:-1]])
        extra = reference_inputs[i] if reference_inputs else {}
        with torch.no_grad():
            ref_logits = reference(full, **extra).logits[0]
        ours = torch.cat([trace.prompt_logits[i], trace.decode_logits[i]])
        assert ours.shape == ref_logits.shape
        scale = ref_logits.abs().max()
        rel_err = ((ours - ref_logits).abs().max() / scale).item()
        assert rel_err < PARITY_TOLERANCE, f"sequence {i}: relative logit error {rel_err:.2e}"
        ref_greedy = ref_logits[len(prompt) - 1 :].argmax(-1).tolist()
        assert generated == ref_greedy, f"sequence {i}: greedy tokens diverge"
