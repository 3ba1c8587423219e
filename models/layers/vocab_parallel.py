"""The token embedding split by vocabulary rows across tensor-parallel ranks.

Rank r holds rows `[r * R, (r + 1) * R)` of the table (R = ceil(vocab / N),
the last rank's tail zero-padded). A rank looks up the ids that fall in its
rows, writes zeros for the others, and the all-reduce sums the ranks' rows
into the whole embedding. With one rank it is a plain lookup.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.config import TensorParallelShard
from models.sharding import vocab_rows_per_rank
from models.tensor_parallel import all_reduce


class VocabParallelEmbedding(torch.nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelShard) -> None:
        super().__init__()
        self.tp = tp
        self.num_rows = vocab_rows_per_rank(vocab_size, tp.size)
        self.first_row = tp.rank * self.num_rows
        # Not initialized: `load_weights` fills it or names it missing (and an
        # init on the meta device would import torch._dynamo, as in rotary.py).
        self.weight = torch.nn.Parameter(torch.empty(self.num_rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first_row
        elsewhere = (local < 0) | (local >= self.num_rows)
        rows = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        rows.masked_fill_(elsewhere.unsqueeze(-1), 0.0)
        return all_reduce(rows, self.tp)
