"""The per-step input of every model: flattened tokens plus cache addressing.

The engine's model runner builds one `ForwardBatch` per step; models read it
and never allocate cache memory themselves. A step mixes prefill chunks and
single decode tokens: sequence `i` contributes the tokens
`input_ids[query_start_loc[i]:query_start_loc[i + 1]]`, at positions
`context_lens[i] ..< seq_lens[i]`.

Paged KV addressing (block_size = 4 in the sketch):

    block_tables[i] = [7, 2, 0, 0]     # logical block j of seq i -> physical block
    token at position p of seq i lives in block block_tables[i][p // 4], offset p % 4
    slot_mapping[t] = physical_block * block_size + offset   (for each new token t)

Physical block 0 is the permanent null block; tables are padded with it.

The runner packs the step's host lists into one array
(`models.host_batch.HostBatch`), which goes to the device in one copy; the
per-sequence counts stay on the host as `batch.shape` (`StepShape`). Layers choose their code path
from `shape` and never read a device tensor back, so a step runs without
stalling the GPU stream and can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepShape:
    """The step's per-sequence counts on the host, where layers branch on them.

    Layers decide what to run from these (which sequences are single tokens,
    which start fresh, how long the longest is) and never read a device
    tensor back for it: on a GPU every such read stalls the stream and makes
    the step impossible to capture in a CUDA graph.
    """

    query_start_loc: tuple[int, ...]
    context_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    mamba_slots: tuple[int, ...] | None = None
    # Speculative verifies of a hybrid model: per sequence, the scratch slots
    # of its draft positions (`kvcache.verify_slots`), () for the others;
    # empty when the step verifies nothing.
    verify_slots: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of_tensors(cls, batch: ForwardBatch) -> StepShape:
        """Read the counts back from a batch built without them (tests build
        batches by hand this way; the model runner never does)."""
        slots = batch.mamba_slots
        return cls(
            tuple(batch.query_start_loc.tolist()),
            tuple(batch.context_lens.tolist()),
            tuple(batch.seq_lens.tolist()),
            None if slots is None else tuple(slots.tolist()),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @functools.cached_property
    def max_seq_len(self) -> int:
        return max(self.seq_lens, default=0)

    @functools.cached_property
    def has_cached_tokens(self) -> bool:
        """Whether some sequence already has tokens in the cache."""
        return any(self.context_lens)

    @functools.cached_property
    def single_token_seqs(self) -> tuple[int, ...]:
        """Sequences that bring exactly one new token (decodes)."""
        starts = self.query_start_loc
        return tuple(i for i in range(self.num_seqs) if starts[i + 1] - starts[i] == 1)

    @functools.cached_property
    def chunk_seqs(self) -> tuple[int, ...]:
        """Sequences that bring more than one new token (prompt chunks)."""
        starts = self.query_start_loc
        return tuple(i for i in range(self.num_seqs) if starts[i + 1] - starts[i] > 1)

    @functools.cached_property
    def verify_seqs(self) -> tuple[int, ...]:
        """Sequences that verify drafts on a hybrid model (chunks whose Mamba
        state is kept after every position, `VerifyRounds`)."""
        return tuple(i for i, slots in enumerate(self.verify_slots) if slots)

    @functools.cached_property
    def scan_seqs(self) -> tuple[int, ...]:
        """Prompt chunks that run the Mamba chunked scan: every chunk but a verify."""
        verifying = set(self.verify_seqs)
        return tuple(i for i in self.chunk_seqs if i not in verifying)

    @functools.cached_property
    def fresh_seqs(self) -> tuple[int, ...]:
        """Sequences with nothing in the cache yet (their Mamba state starts at zero)."""
        return tuple(i for i, ctx in enumerate(self.context_lens) if ctx == 0)


@dataclass(frozen=True)
class MambaRows:
    """Device index tensors the Mamba mixer needs, built with the batch.

    step_rows: `[n]` token rows of the single-token sequences.
    step_slots: `[n]` their state slots.
    fresh_slots: `[m]` slots of the sequences that start at position 0.
    """

    step_rows: torch.Tensor
    step_slots: torch.Tensor
    fresh_slots: torch.Tensor

    @staticmethod
    def host_lists(shape: StepShape) -> tuple[list[int], list[int], list[int]]:
        """`(step_rows, step_slots, fresh_slots)` as host lists."""
        slots = shape.mamba_slots or ()
        if not slots:
            return [], [], []
        single = shape.single_token_seqs
        return (
            [shape.query_start_loc[i] for i in single],
            [slots[i] for i in single],
            [slots[i] for i in shape.fresh_seqs],
        )


@dataclass(frozen=True)
class VerifyRound:
    """Position j of every verify sequence that has one, as one batched Mamba
    step: the token rows, the slots their state is read from and the slots
    the new state goes to (see `kvcache.verify_slots`)."""

    rows: torch.Tensor
    read_slots: torch.Tensor
    write_slots: torch.Tensor

    @staticmethod
    def host_lists(shape: StepShape) -> list[tuple[list[int], list[int], list[int]]]:
        """Per position, `(rows, read_slots, write_slots)` as host lists."""
        verify, slots = shape.verify_seqs, shape.mamba_slots
        if not verify or slots is None:
            return []
        starts = shape.query_start_loc
        depth = max(len(shape.verify_slots[i]) for i in verify)
        rounds: list[tuple[list[int], list[int], list[int]]] = []
        for j in range(depth + 1):
            rows: list[int] = []
            read: list[int] = []
            write: list[int] = []
            for i in verify:
                scratch = shape.verify_slots[i]
                drafts = len(scratch)
                if starts[i + 1] - starts[i] != drafts + 1:
                    raise ValueError(
                        f"sequence {i} verifies {drafts} drafts but brings "
                        f"{starts[i + 1] - starts[i]} tokens"
                    )
                if j > drafts:
                    continue
                rows.append(starts[i] + j)
                read.append(slots[i] if j == 0 else scratch[j - 1])
                write.append(slots[i] if j == drafts else scratch[j])
            rounds.append((rows, read, write))
        return rounds


@dataclass(frozen=True)
class DecodeRows:
    """The single-token sequences of a step that also carries prompt chunks,
    gathered so their attention runs as one batched decode call.

    token_rows: `[n]` flattened token index of each one's query.
    block_tables: `[n, max_blocks]`, seq_lens: `[n]`: their rows of the batch's.
    max_seq_len: the longest of them (host int).
    """

    token_rows: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int


@dataclass(frozen=True)
class ChunkRows:
    """The prompt chunks of a step (sequences with more than one new token),
    for kernels that take them one tile of tokens at a time.

    starts, lens: `[n]` first flattened token row and token count of each.
    block_tables: `[n, max_blocks]`, seq_lens: `[n]`: their rows of the batch's.
    query_keys: sum over them of tokens x keys after the step (host int), a
        bound on the keys their queries read (twice the causal count).
    """

    starts: torch.Tensor
    lens: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_keys: int


@dataclass(frozen=True)
class PaddedPrompts:
    """A step of sequences that all start at position 0, padded to its longest, `L`:

    rows: `[B, L]` flattened token index of position `j` of sequence `i` (0
        where padded); None when every sequence has `L` tokens (the tokens
        then reshape to `[B, L]` as they are).
    valid: `[B, L]`, `j < seq_lens[i]`.
    token_slots: `[T]` where each token sits in the flattened `[B * L]`
        padding (None with `rows`), to take the tokens back out of it.
    """

    rows: torch.Tensor | None
    valid: torch.Tensor
    token_slots: torch.Tensor | None


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int64, cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int64, tokens in cache after this step
    context_lens: torch.Tensor  # [B] int64, tokens already in cache before this step
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    slot_mapping: torch.Tensor  # [T] int64
    block_size: int
    mamba_slots: torch.Tensor | None = None  # [B] int64 slot per sequence (hybrid models)
    logits_indices: torch.Tensor | None = None  # [N] rows of the hidden states to turn into logits
    # The same counts on the host; read back from the tensors when not given.
    shape: StepShape = None  # type: ignore[assignment]
    # Mamba index tensors; built from `shape` when not given (hybrid models only).
    mamba_rows: MambaRows | None = None
    # Image placeholder tokens: row `image_rows[i]` of the step takes embedding
    # `image_embeds[i]` instead of its token's (VL models; None without images).
    image_rows: torch.Tensor | None = None  # [M] int64
    image_embeds: torch.Tensor | None = None  # [M, hidden_size]

    def __post_init__(self) -> None:
        if self.shape is None:
            self.shape = StepShape.of_tensors(self)
        if self.mamba_slots is not None and self.mamba_rows is None:
            device = self.mamba_slots.device
            self.mamba_rows = MambaRows(
                *(
                    torch.tensor(values, dtype=torch.int64, device=device)
                    for values in MambaRows.host_lists(self.shape)
                )
            )

    def input_embeddings(self, embedding: torch.nn.Module) -> torch.Tensor:
        """`[T, hidden]` token embeddings (`embedding` maps ids to rows: a plain or a
        vocab-parallel table), image rows replaced by their embeddings."""
        hidden = embedding(self.input_ids)
        if self.image_rows is not None and self.image_embeds is not None:
            hidden[self.image_rows] = self.image_embeds.to(hidden.dtype)
        return hidden

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def is_decode_only(self) -> bool:
        return self.num_tokens == self.num_seqs

    @property
    def max_seq_len(self) -> int:
        return self.shape.max_seq_len

    # Derived once per step and shared by every attention layer. The batch is
    # never mutated after the runner builds it, so caching is safe.

    @functools.cached_property
    def verify_rounds(self) -> list[VerifyRound]:
        """The step's speculative verifies on a hybrid model, position by
        position (`VerifyRound`); empty without any."""
        device = self.seq_lens.device
        return [
            VerifyRound(*(torch.tensor(v, dtype=torch.int64, device=device) for v in lists))
            for lists in VerifyRound.host_lists(self.shape)
        ]

    @functools.cached_property
    def slot_blocks_offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(block, offset)` of every new token's slot: `slot_mapping` split."""
        blocks = torch.div(self.slot_mapping, self.block_size, rounding_mode="floor")
        return blocks, self.slot_mapping - blocks * self.block_size

    @functools.cached_property
    def token_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every new token as a one-query sequence: `(block_tables, seq_lens)`,
        `[T, blocks]` and `[T]`, its sequence's table row (cut to the blocks
        the step reads) and its position + 1 (the keys it sees, itself
        included). Causal attention over the cache is then decode attention
        over these rows.

            seq 0: context 2, 3 new tokens at positions 2, 3, 4 -> rows 0..2
            rows 0..2: block_tables[0], seq_lens 3, 4, 5
        """
        blocks = -(-self.max_seq_len // self.block_size)
        tables = self.block_tables[:, :blocks].repeat_interleave(
            self.query_lens, dim=0, output_size=self.num_tokens
        )
        return tables, self.positions + 1

    @functools.cached_property
    def all_seq_rows(self) -> DecodeRows:
        """Every sequence as a decode row (its first token's), for a
        decode-only step: built once, not once per attention layer."""
        return DecodeRows(
            self.query_start_loc[:-1], self.block_tables, self.seq_lens, self.max_seq_len
        )

    @functools.cached_property
    def decode_rows(self) -> DecodeRows | None:
        """The step's single-token sequences (see `DecodeRows`); None without any."""
        single = self.shape.single_token_seqs
        if not single:
            return None
        device = self.seq_lens.device
        seqs = torch.tensor(single, dtype=torch.int64, device=device)
        starts = self.shape.query_start_loc
        return DecodeRows(
            token_rows=torch.tensor([starts[i] for i in single], dtype=torch.int64, device=device),
            block_tables=self.block_tables.index_select(0, seqs),
            seq_lens=self.seq_lens.index_select(0, seqs),
            max_seq_len=max(self.shape.seq_lens[i] for i in single),
        )

    @functools.cached_property
    def chunk_rows(self) -> ChunkRows | None:
        """The step's prompt chunks (see `ChunkRows`); None without any."""
        chunks = self.shape.chunk_seqs
        if not chunks:
            return None
        device = self.seq_lens.device
        seqs = torch.tensor(chunks, dtype=torch.int64, device=device)
        starts, seq_lens = self.shape.query_start_loc, self.shape.seq_lens
        lens = [starts[i + 1] - starts[i] for i in chunks]
        return ChunkRows(
            starts=torch.tensor([starts[i] for i in chunks], dtype=torch.int64, device=device),
            lens=torch.tensor(lens, dtype=torch.int64, device=device),
            block_tables=self.block_tables.index_select(0, seqs),
            seq_lens=self.seq_lens.index_select(0, seqs),
            query_keys=sum(n * seq_lens[i] for n, i in zip(lens, chunks, strict=True)),
        )

    @functools.cached_property
    def padded_prefill_layout(self) -> PaddedPrompts | None:
        """The step as padded prompts (`PaddedPrompts`), for a step whose every
        sequence starts at position 0 (whole prompts or first chunks); None
        when some sequence already has tokens in the cache."""
        if self.num_seqs == 0 or self.shape.has_cached_tokens:
            return None
        width = self.max_seq_len
        device = self.seq_lens.device
        cols = torch.arange(width, device=device)[None, :]
        valid = cols < self.seq_lens[:, None]
        if self.num_tokens == self.num_seqs * width:
            return PaddedPrompts(None, valid, None)
        rows = torch.where(valid, self.query_start_loc[:-1, None] + cols, 0)
        # From the host counts: a boolean-mask index of the padded output
        # would read the number of valid rows back from the device.
        lens = self.shape.seq_lens
        slots = [i * width + j for i, n in enumerate(lens) for j in range(n)]
        return PaddedPrompts(rows, valid, torch.tensor(slots, dtype=torch.int64, device=device))
