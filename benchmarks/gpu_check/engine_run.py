"""Part 2: the engine core on the device against the same requests on CPU fp32.

Continuous batching with chunked prefill (a token budget smaller than the
prompts) and a cache too small for every request at once, so the scheduler
preempts and recomputes. Greedy tokens must equal those of the CPU fp32 run
of the same requests, token for token, for a dense and a hybrid model, and
for the dense one again with its decode steps replayed from CUDA graphs. The
CPU run has room for everything (whole prompts, no preemption), so under
`--device cpu` the check still compares two different schedules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_check.engine_setup import build_engine, checkpoint, greedy, run_to_completion
from benchmarks.gpu_check.report import needs_cuda
from engine.request import Request

# Prompt lengths; with a 24-token budget the longer ones prefill in chunks.
PROMPT_LENGTHS = (5, 40, 17, 33, 9, 26)
BLOCK_SIZE = 4
# 6 requests of up to 40 + 12 tokens need ~60 blocks; 24 force preemptions.
NUM_BLOCKS = 24


def _requests(vocab: int, new_tokens: int) -> list[Request]:
    gen = torch.Generator().manual_seed(5)
    return [
        Request(f"r{i}", torch.randint(3, vocab, (n,), generator=gen).tolist(), greedy(new_tokens))
        for i, n in enumerate(PROMPT_LENGTHS)
    ]


def _run(
    path: Path, device: str, new_tokens: int, constrained: bool, graphs: bool = False
) -> tuple[dict[str, list[int]], int, int]:
    """(tokens per request, preemptions, decode steps replayed from CUDA graphs,
    or -1 when no graphs were captured)."""
    engine = build_engine(
        path,
        device,
        "float32",
        num_blocks=NUM_BLOCKS if constrained else 256,
        block_size=BLOCK_SIZE,
        max_num_tokens=24 if constrained else 512,
        max_batch_size=4 if constrained else len(PROMPT_LENGTHS),
        graph_batch_sizes=(1, 2, 4) if graphs else (),
    )
    tokens, preempted = run_to_completion(engine, _requests(engine.config.vocab_size, new_tokens))
    replays = engine.runner.graphs.num_replays if engine.runner.graphs is not None else -1
    return tokens, preempted, replays


def check_engine(root: Path, device: str, new_tokens: int) -> list[dict[str, Any]]:
    """Rows for Llama and Nemotron-H eagerly, and on CUDA Llama with decode
    CUDA graphs (on CPU graphs are skipped: that row would repeat the first)."""
    rows = []
    runs = [("llama", False), ("nemotron_h", False)]
    for arch, graphs in [*runs, ("llama", True)] if device == "cuda" else runs:
        path = checkpoint(root, arch, "tiny")
        ours, preempted, replays = _run(path, device, new_tokens, True, graphs)
        cpu, _, _ = _run(path, "cpu", new_tokens, constrained=False)
        equal = sum(ours[rid] == cpu[rid] for rid in ours)
        rows.append(
            {
                "arch": arch,
                "graphs_asked": graphs,
                "cuda_graphs": replays >= 0,
                "graph_replays": max(replays, 0),
                "requests": len(ours),
                "equal_to_cpu_fp32": equal,
                "preemptions": preempted,
                "ok": equal == len(ours) and preempted > 0 and (replays > 0 or not graphs),
            }
        )
    if device != "cuda":
        rows.append(needs_cuda("decode steps replayed from CUDA graphs", arch="llama"))
    return rows
