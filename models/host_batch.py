"""A step's index lists packed on the host, before they go to the device.

The model runner flattens a step into host lists (token ids, positions,
block tables, slots, ...); `HostBatch.pack` copies them all into one int64
numpy array, and `to_device` moves that array in one copy and hands out the
fields of a `ForwardBatch` as views of it.

The packed form is also what rank 0 of a tensor-parallel instance sends the
other ranks each step: a numpy array pickles as one buffer (Ray moves it
out of band), where lists of ints pickle and unpickle element by element,
and then had to be packed again on the receiving rank, all before its
forward could start (docs/performance.md, "Engine").

    packed: | input_ids | positions | query_start_loc | seq_lens | context_lens |
            | slot_mapping | block_tables (rows x width) | mamba_slots |
            | logits_indices | mamba step_rows | step_slots | fresh_slots |

Each list starts at an even index (16 bytes): Triton compiles a kernel per
alignment of its pointer arguments (16-byte aligned or not), so fields at
odd offsets, which came and went with the lists' lengths, compiled new
variants of the decode attention kernel (each a compile long enough to
stall a step; docs/performance.md) in the middle of serving, after the
warm-up had compiled the aligned ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from models.batch import ForwardBatch, MambaRows, StepShape


@dataclass(frozen=True)
class HostBatch:
    packed: npt.NDArray[np.int64]  # the lists, one after another (see the module sketch)
    sizes: tuple[int, ...]  # each list's length in `packed`
    spans: tuple[int, ...]  # each list's room in `packed`: its length rounded up to even
    table_rows: int
    table_width: int
    block_size: int
    shape: StepShape
    has_mamba: bool
    has_logits: bool  # logits_indices given (possibly empty)

    @classmethod
    def pack(
        cls,
        *,
        input_ids: Sequence[int],
        positions: Sequence[int],
        query_start_loc: Sequence[int],
        seq_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        slot_mapping: Sequence[int],
        block_size: int,
        mamba_slots: Sequence[int] | None = None,
        logits_indices: Sequence[int] | None = None,
        table_width: int | None = None,
        verify_slots: Sequence[Sequence[int]] = (),
    ) -> HostBatch:
        """Block tables are padded with the null block to `table_width`
        (default: the longest). `verify_slots`: per sequence, the Mamba
        scratch slots of its draft positions (hybrid verifies; see `StepShape`)."""
        shape = StepShape(
            tuple(query_start_loc),
            tuple(context_lens),
            tuple(seq_lens),
            None if mamba_slots is None else tuple(mamba_slots),
            tuple(map(tuple, verify_slots)),
        )
        width = table_width if table_width is not None else max(map(len, block_tables), default=0)
        mamba_lists = MambaRows.host_lists(shape) if mamba_slots is not None else ([], [], [])
        before = [input_ids, positions, query_start_loc, seq_lens, context_lens, slot_mapping]
        after = [mamba_slots or [], logits_indices or [], *mamba_lists]
        sizes = (*map(len, before), len(block_tables) * width, *map(len, after))
        spans = tuple(n + (n & 1) for n in sizes)
        packed = np.zeros(sum(spans), dtype=np.int64)
        start = 0
        for part, size, span in zip((*before, None, *after), sizes, spans, strict=True):
            if part is None:  # the block tables
                grid = packed[start : start + size].reshape(len(block_tables), width)
                fill_rows(grid, block_tables, pad=0)
            elif size:
                packed[start : start + size] = part
            start += span
        return cls(
            packed,
            sizes,
            spans,
            len(block_tables),
            width,
            block_size,
            shape,
            mamba_slots is not None,
            logits_indices is not None,
        )

    @property
    def num_logits(self) -> int:
        return self.sizes[8]

    def to_device(self, device: torch.device) -> ForwardBatch:
        """The batch on `device`, moved in one copy (from pinned memory on CUDA);
        its fields are views of that copy."""
        # An array that arrived from another process may be read-only; torch
        # wants to own writable memory.
        packed = self.packed if self.packed.flags.writeable else self.packed.copy()
        host = torch.from_numpy(packed)
        if device.type == "cuda":
            host = host.pin_memory()
        ids, pos, starts, lens, ctx, slots, tables, mamba, logits, *rows = (
            span[:size]
            for span, size in zip(
                host.to(device, non_blocking=True).split(list(self.spans)), self.sizes, strict=True
            )
        )
        return ForwardBatch(
            input_ids=ids,
            positions=pos,
            query_start_loc=starts,
            seq_lens=lens,
            context_lens=ctx,
            block_tables=tables.view(self.table_rows, self.table_width),
            slot_mapping=slots,
            block_size=self.block_size,
            mamba_slots=mamba if self.has_mamba else None,
            logits_indices=logits if self.has_logits else None,
            shape=self.shape,
            mamba_rows=MambaRows(*rows) if self.has_mamba else None,
        )


def fill_rows(grid: npt.NDArray[np.int64], rows: Sequence[Sequence[int]], pad: int) -> None:
    """`grid[i]` = `rows[i]`, padded with `pad` to the grid's width.

    Through numpy, which copies a list into a row in C: 64 block tables of
    516 ids about 8x faster than flattening them in Python, and a list of
    8,192 token ids about 4x faster than `torch.as_tensor`.
    """
    grid.fill(pad)
    for row, values in zip(grid, rows, strict=True):
        row[: len(values)] = values
