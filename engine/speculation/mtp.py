"""MTP drafting: the checkpoint's multi-token-prediction layers, run after
each forward on the target's final hidden states (Nemotron-H's `mtp.*`,
`models/nemotron_h_mtp.py`).

At position p the MTP module takes the token at p + 1 and the target's
hidden state at p, and predicts the token at p + 2. Its attention layer is
one more attention layer of the paged cache (`ModelConfig.use_mtp`): it
writes K/V at p in the request's blocks and reads the request's earlier
positions there, so the prompt's MTP K/V travels with the prompt's cache
and a generation worker continues where the context worker stopped.

Each step, after sampling:

1. **Catch-up.** For every scheduled chunk, the MTP runs over the positions
   the step computed and keeps: a prefill chunk's positions (the token after
   the last one is the next prompt token, or the token just sampled), a
   decode's one position, a verify's last token and its accepted drafts (the
   token after them is the one sampled after the last accepted draft).
2. **First draft.** The last kept position's MTP logits give draft 1 of each
   sampling request: the token after the one just sampled.
3. **Chain.** Draft j + 1 runs the MTP once more per request, one row at the
   next position, on draft j and the MTP's own output hidden state there.

Drafts are the argmax of the MTP logits for greedy and sampled requests
alike: the verify samples every position as plain decoding would and keeps
drafts up to the first difference (`engine.speculation.verify`), so what a
draft is never changes the output, only how many tokens a step keeps.

The chain writes MTP K/V past the kept positions. It stays inside the block
that holds the last kept position, which the request keeps whatever a
verify settles, and the next step's catch-up overwrites those positions
before anything reads them. So a request whose last kept token sits at the
end of its block drafts fewer tokens that step (with 16-token blocks and 3
drafts: 2 of 16 positions).

A reused prefix block keeps the MTP K/V of the request that computed it,
whose token after the block may differ from the new request's: that
position's MTP K/V is then the other request's. It changes drafts only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvcache.views import CacheViews
from models.batch import ForwardBatch
from models.host_batch import HostBatch


class MTPModel(Protocol):
    def mtp_forward(
        self,
        input_ids: torch.Tensor,
        target_hidden: torch.Tensor,
        batch: ForwardBatch,
        caches: CacheViews,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class KeptChunk:
    """What one scheduled chunk computed and keeps, for the MTP catch-up.

    `next_tokens[j]` is the token after position `start + j`; `hidden_row`
    is the chunk's first row in the step's hidden states; `drafts` whether
    the request drafts from its last kept position.
    """

    index: int  # the chunk's index among the step's sequences
    request_id: str
    start: int
    next_tokens: tuple[int, ...]
    hidden_row: int
    table: Sequence[int]
    drafts: bool

    @property
    def last(self) -> int:
        """The last kept position."""
        return self.start + len(self.next_tokens) - 1


def mtp_drafting(model: object, num_drafts: int, block_size: int, device: str) -> MTPDrafting:
    """The MTP layers of `model` as a runner's drafter; `ValueError` for a
    model without them."""
    if not callable(getattr(model, "mtp_forward", None)):
        raise ValueError(
            f"{type(model).__name__} has no MTP layers: speculative_config.method mtp "
            "needs a Nemotron-H checkpoint with num_nextn_predict_layers > 0"
        )
    return MTPDrafting(model, num_drafts, block_size, torch.device(device))  # type: ignore[arg-type]


class MTPDrafting:
    """Runs the catch-up and the chain (see the module docstring). Under
    tensor parallelism every rank runs it on the same kept chunks: the
    hidden states and the gathered logits are the same on every rank, so
    every rank drafts the same tokens and meets the same collectives."""

    def __init__(
        self, model: MTPModel, num_drafts: int, block_size: int, device: torch.device
    ) -> None:
        self.model = model
        self.num_drafts = num_drafts
        self.block_size = block_size
        self.device = device

    def draft(
        self, chunks: Sequence[KeptChunk], hidden: torch.Tensor, caches: CacheViews
    ) -> dict[int, list[int]]:
        """Run the catch-up and the chain; the drafts of each drafting chunk, by `index`."""
        chunks = [c for c in chunks if c.next_tokens]
        if not chunks:
            return {}
        bs = self.block_size
        rows: list[int] = []
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        logits_rows: list[int] = []
        for c in chunks:
            n = len(c.next_tokens)
            rows.extend(range(c.hidden_row, c.hidden_row + n))
            ids.extend(c.next_tokens)
            span = range(c.start, c.start + n)
            positions.extend(span)
            slots.extend(c.table[p // bs] * bs + p % bs for p in span)
            starts.append(len(ids))
            if c.drafts:
                logits_rows.append(len(ids) - 1)
        batch = self._batch(
            ids,
            positions,
            starts,
            [c.start for c in chunks],
            [c.last + 1 for c in chunks],
            [c.table for c in chunks],
            slots,
        )
        index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        out = self.model.mtp_forward(batch.input_ids, hidden[index], batch, caches)
        drafting = [c for c in chunks if c.drafts]
        if not drafting:
            return {}
        last = out[torch.tensor(logits_rows, dtype=torch.long, device=out.device)]
        tokens = self._argmax(last)
        drafts = {c.index: [t] for c, t in zip(drafting, tokens, strict=True)}
        for step in range(1, self.num_drafts):
            # Rows still inside the block of their last kept position.
            live = [
                i
                for i, c in enumerate(drafting)
                if (c.last + step) // bs == c.last // bs and len(drafts[c.index]) == step
            ]
            if not live:
                break
            chosen = [drafting[i] for i in live]
            pos = [c.last + step for c in chosen]
            batch = self._batch(
                [drafts[c.index][-1] for c in chosen],
                pos,
                list(range(len(chosen) + 1)),
                pos,
                [p + 1 for p in pos],
                [c.table for c in chosen],
                [c.table[p // bs] * bs + p % bs for c, p in zip(chosen, pos, strict=True)],
            )
            picked = torch.tensor(live, dtype=torch.long, device=last.device)
            last_live = self.model.mtp_forward(batch.input_ids, last[picked], batch, caches)
            for c, t in zip(chosen, self._argmax(last_live), strict=True):
                drafts[c.index].append(t)
            last = last.index_copy(0, picked, last_live)
        return drafts

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        logits = self.model.compute_logits(hidden)
        return [int(t) for t in logits.argmax(dim=-1).tolist()]

    def _batch(
        self,
        input_ids: list[int],
        positions: list[int],
        query_start_loc: list[int],
        context_lens: list[int],
        seq_lens: list[int],
        tables: list[Sequence[int]],
        slot_mapping: list[int],
    ) -> ForwardBatch:
        host = HostBatch.pack(
            input_ids=input_ids,
            positions=positions,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            context_lens=context_lens,
            block_tables=tables,
            slot_mapping=slot_mapping,
            block_size=self.block_size,
        )
        return host.to_device(self.device)
