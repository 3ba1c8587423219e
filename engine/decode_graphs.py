"""CUDA graphs of the decode step, one per batch size of a fixed set.

A decode step launches a few kernels per layer; at small batches the GPU then
waits on the host launching them. Capturing the step once per batch size and
replaying it costs one launch. A graph replays fixed addresses and shapes, so
every captured size owns a view of one set of static input buffers:

    step of 5 sequences, sizes (1, 2, 4, 8, 16):  bucket 8
    input_ids    [t0 t1 t2 t3 t4 | 0 0 0]          padding rows:
    seq_lens     [s0 s1 s2 s3 s4 | 0 0 0]            seq_len 0 (attention yields 0)
    slot_mapping [.. .. .. .. .. | 0 0 0]            K/V written to the null block 0
    block_tables [5 x w real     | zeros ]  width W = max blocks per sequence

Replay copies the step into the buffers (device to device, no host read),
replays the bucket's graph and returns the first rows of its output. Steps
that do not fit (a prefill chunk, more sequences than the largest size, a
table wider than W) run eagerly. The padded batch runs the same code eagerly
too (`StaticDecodeBatch.fill`), which is how CPU tests check the padding.

Hybrid models run eagerly: a padding row would update a real Mamba state
slot, and the slot pool has no spare one.
"""

from __future__ import annotations

import bisect
import logging
import os
from collections.abc import Sequence
from typing import Protocol

import torch

from kvcache.views import CacheViews
from models.batch import ForwardBatch, StepShape

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Set to 0 to run every decode step eagerly on CUDA too.
CUDA_GRAPHS_ENV = "DISAGG_CUDA_GRAPHS"


def graph_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """The sizes to capture for a worker that runs at most `max_batch_size`
    sequences per step: the defaults below it, and itself."""
    if os.environ.get(CUDA_GRAPHS_ENV, "1") == "0":
        return ()
    return (*(s for s in DEFAULT_BATCH_SIZES if s < max_batch_size), max_batch_size)


class DecodeModel(Protocol):
    def forward(self, batch: ForwardBatch, caches: CacheViews) -> torch.Tensor: ...


def bucket_for(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds `num_seqs` sequences; None if none does."""
    ordered = sorted(sizes)
    i = bisect.bisect_left(ordered, num_seqs)
    return ordered[i] if i < len(ordered) else None


class StaticDecodeBatch:
    """Fixed buffers for decode steps of up to `max_seqs` sequences."""

    def __init__(
        self, max_seqs: int, max_blocks: int, block_size: int, device: torch.device
    ) -> None:
        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)

        self.max_blocks = max_blocks
        self.block_size = block_size
        self.input_ids = longs(max_seqs)
        self.positions = longs(max_seqs)
        self.seq_lens = longs(max_seqs)
        self.context_lens = longs(max_seqs)
        self.slot_mapping = longs(max_seqs)
        self.block_tables = longs(max_seqs, max_blocks)
        self.query_start_loc = torch.arange(max_seqs + 1, dtype=torch.int64, device=device)

    def fits(self, batch: ForwardBatch) -> bool:
        return (
            batch.is_decode_only
            and batch.mamba_slots is None
            and batch.num_seqs <= self.input_ids.shape[0]
            and batch.block_tables.shape[1] <= self.max_blocks
        )

    def view(self, size: int) -> ForwardBatch:
        """The batch a graph of `size` rows captures: views of the buffers.

        Its host shape is the worst case of any step it will replay (every
        sequence as long as the table holds), so host-side choices made from
        it (widths, code paths) hold for all of them.
        """
        longest = self.max_blocks * self.block_size
        return ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            context_lens=self.context_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            block_size=self.block_size,
            shape=StepShape(tuple(range(size + 1)), (longest - 1,) * size, (longest,) * size),
        )

    def fill(self, batch: ForwardBatch, size: int) -> ForwardBatch:
        """Copy a decode step of at most `size` sequences into the buffers,
        pad the rest, and return `view(size)`."""
        n, width = batch.num_seqs, batch.block_tables.shape[1]
        for static, real in (
            (self.input_ids, batch.input_ids),
            (self.positions, batch.positions),
            (self.seq_lens, batch.seq_lens),
            (self.context_lens, batch.context_lens),
            (self.slot_mapping, batch.slot_mapping),
        ):
            static[:n].copy_(real)
            static[n:size].zero_()
        self.block_tables[:size].zero_()
        self.block_tables[:n, :width].copy_(batch.block_tables)
        return self.view(size)


class DecodeGraphs:
    """Captured decode steps of `model` for `batch_sizes`, replayed by `run`."""

    def __init__(
        self,
        model: DecodeModel,
        caches: CacheViews,
        static: StaticDecodeBatch,
        batch_sizes: Sequence[int],
    ) -> None:
        self.model = model
        self.caches = caches
        self.static = static
        self.sizes = sorted(batch_sizes)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0

    def capture(self) -> None:
        """Capture every size, largest first (smaller graphs reuse its memory pool).

        Runs each step once eagerly first, which also compiles its kernels.
        The padding rows write K/V only into the null block.
        """
        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):
                self.model.forward(self.static.view(size), self.caches)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                # A fresh view: the batch caches tensors derived from its
                # fields, and the graph must compute them, not reuse them.
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model.forward(self.static.view(size), self.caches)
                pool = graph.pool()
                self.graphs[size] = (graph, out)
        torch.cuda.synchronize()

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Hidden states `[num_seqs, hidden]` of a decode step by graph replay;
        None when the step does not fit a captured graph (run it eagerly)."""
        size = bucket_for(batch.num_seqs, self.sizes)
        if size is None or not self.static.fits(batch):
            return None
        self.static.fill(batch, size)
        graph, out = self.graphs[size]
        graph.replay()
        self.num_replays += 1
        return out[: batch.num_seqs]


def build_decode_graphs(
    model: DecodeModel,
    caches: CacheViews,
    *,
    batch_sizes: Sequence[int],
    max_blocks: int,
    block_size: int,
    device: torch.device,
    is_hybrid: bool,
) -> DecodeGraphs | None:
    """Captured decode graphs, or None (eager decode) with a log line saying why."""
    if not batch_sizes:
        return None
    if device.type != "cuda":
        logger.info("CUDA graphs: skipped on %s, decode steps run eagerly", device.type)
        return None
    if is_hybrid:
        logger.info(
            "CUDA graphs: skipped for a hybrid model (padding rows would need a spare "
            "Mamba state slot); decode steps run eagerly"
        )
        return None
    static = StaticDecodeBatch(max(batch_sizes), max_blocks, block_size, device)
    graphs = DecodeGraphs(model, caches, static, batch_sizes)
    try:
        graphs.capture()
    except RuntimeError as error:  # a kernel or op that cannot be captured
        logger.warning("CUDA graphs: capture failed (%s); decode steps run eagerly", error)
        return None
    logger.info("CUDA graphs: captured decode steps for batch sizes %s", graphs.sizes)
    return graphs
