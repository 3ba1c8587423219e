"""Part 5: decode throughput per batch size, and where a decode step's time goes.

For each batch size the engine core (embedded `small` Llama in bf16 on a
GPU) takes that many requests at once, prefills them, then runs decode-only
steps. Per step: wall time, and its split into scheduling, batch building,
model (forward + logits, device time included) and the host-side rest
(sampling and the engine's bookkeeping). Device-to-host syncs of one decode
step's forward pass are counted too (`models.host_reads`), and that first
decode forward is timed: it stays near `model_ms` when the startup warm-up
compiled every decode kernel. Each size runs
eagerly and then with CUDA graphs (reporting how many requests generated
the same tokens as eagerly); on CPU graphs are skipped and only eager runs.
"""

from __future__ import annotations

import time
from pathlib import Path
from statistics import median
from typing import Any

import torch

from benchmarks.gpu_check.engine_setup import Engine, build_engine, greedy, synchronize
from engine.request import Request
from models.host_reads import count_host_reads

PROMPT_LEN = 32
BLOCK_SIZE = 16


def _requests(n: int, steps: int, vocab: int) -> list[Request]:
    gen = torch.Generator().manual_seed(n)
    return [
        Request(
            f"r{i}",
            torch.randint(3, vocab, (PROMPT_LEN,), generator=gen).tolist(),
            greedy(steps + 1),
        )
        for i in range(n)
    ]


def _first_decode_forward(engine: Engine, device: str) -> tuple[int, float]:
    """(host reads, seconds) of the first decode step's forward pass after the
    prefill. Slow only if the startup warm-up missed a kernel compilation."""
    sched = engine.core.scheduler.schedule()
    batch = engine.runner.build_batch(sched.sequences)
    synchronize(device)
    start = time.perf_counter()
    with count_host_reads(device) as reads, torch.inference_mode():
        engine.model.forward(batch, engine.runner.caches)
    synchronize(device)
    seconds = time.perf_counter() - start
    engine.core.scheduler.commit(sched)  # the step's tokens are discarded
    for seq in sched.sequences:
        seq.request.append_output(0)
    return reads.count, seconds


def _measure(
    engine: Engine, batch_size: int, steps: int, device: str
) -> tuple[dict[str, Any], list[list[int]]]:
    """The row's figures, and the tokens every request generated."""
    requests = _requests(batch_size, steps, engine.config.vocab_size)
    for request in requests:
        engine.core.add(request)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.core.requests.values()):
        engine.core.step()  # prefill (and first tokens)
    syncs, first_s = _first_decode_forward(engine, device)
    walls, schedule, build, model, sample = [], [], [], [], []
    while engine.core.has_work():
        start = time.perf_counter()
        result = engine.core.step()
        walls.append(time.perf_counter() - start)
        schedule.append(result.schedule_s)
        build.append(result.timings.build_s)
        model.append(result.timings.forward_s)
        sample.append(result.timings.sample_s)
    wall = median(walls)
    host = wall - median(schedule) - median(build) - median(model)
    row = {
        "decode_steps": len(walls),
        "step_ms": wall * 1e3,
        # Near model_ms when the startup warm-up compiled every decode kernel.
        "first_forward_ms": first_s * 1e3,
        "tokens_per_s": batch_size / wall,
        "schedule_ms": median(schedule) * 1e3,
        "build_ms": median(build) * 1e3,
        "model_ms": median(model) * 1e3,
        "host_other_ms": host * 1e3,
        "syncs_per_decode_forward": syncs,
    }
    return row, [r.output_token_ids for r in requests]


def check_throughput(
    path: Path, device: str, dtype: str, batch_sizes: list[int], steps: int
) -> list[dict[str, Any]]:
    rows = []
    eager_tokens: dict[int, list[list[int]]] = {}
    modes = (False, True) if torch.device(device).type == "cuda" else (False,)
    for graphs in modes:
        for batch_size in batch_sizes:
            engine = build_engine(
                path,
                device,
                dtype,
                num_blocks=batch_size * -(-(PROMPT_LEN + steps + 2) // BLOCK_SIZE) + 1,
                block_size=BLOCK_SIZE,
                max_num_tokens=max(512, batch_size * PROMPT_LEN),
                max_batch_size=batch_size,
                graph_batch_sizes=(batch_size,) if graphs else (),
            )
            row: dict[str, Any] = {
                "batch": batch_size,
                "cuda_graphs": engine.runner.graphs is not None,
            }
            figures, tokens = _measure(engine, batch_size, steps, device)
            row.update(figures)
            if graphs:  # bf16: reported; a padded step may round differently
                same = sum(a == b for a, b in zip(tokens, eager_tokens[batch_size], strict=True))
                row["requests_equal_to_eager"] = same / batch_size
            eager_tokens.setdefault(batch_size, tokens)
            # The forward pass is free of host reads (a sync would break graphs).
            row["ok"] = row["syncs_per_decode_forward"] == 0
            rows.append(row)
            del engine
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
    return rows
