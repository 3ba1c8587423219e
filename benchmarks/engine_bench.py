"""Engine benchmark: decode tokens/s and TTFT per batch size, aggregated and 1P1D.

Runs the worker classes in this process (one asyncio loop; the 1P1D pair
talks through the Python transceiver over localhost TCP), on the embedded
`small` checkpoint unless `--checkpoint` names another. For every batch size
it submits that many requests at once (same prompt length, fixed output
length, EOS ignored) and reports:

- TTFT: mean and max seconds from submission to the first token;
- decode tok/s: tokens generated after each request's first token, divided
  by the time from the first to the last token of the batch;
- per-step breakdown: scheduling + batch building vs model forward (+ sampling).

    python -m benchmarks.engine_bench --batch-sizes 1 8 64 --max-seconds 300
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from decode_worker.worker import GenerationWorker
from engine.messages import ContextRequest, GenerationRequest
from engine.sampling import SamplingParams
from engine.worker_config import WorkerConfig
from prefill_worker.worker import ContextWorker

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class RunResult:
    mode: str
    batch_size: int
    ttft_mean_s: float
    ttft_max_s: float
    decode_tok_s: float
    steps: int
    schedule_build_ms: float  # per step
    forward_ms: float  # per step
    sample_ms: float  # per step


def _params(new_tokens: int) -> Any:
    return SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=gen).tolist() for _ in range(batch)]


async def _one(
    ctx: ContextWorker | None, gen: GenerationWorker, rid: str, prompt: list[int], new: int
) -> tuple[float, float, float]:
    """(submitted, first token, last token) wall-clock times of one request."""
    start = time.perf_counter()
    first: float | None = None
    context = None
    if ctx is not None:
        context = await ctx.prefill(ContextRequest(rid, prompt, _params(new)))
        first = time.perf_counter()
    async for event in gen.generate(GenerationRequest(rid, prompt, _params(new), context)):
        if event.error:
            raise RuntimeError(event.error)
        if first is None and event.token_ids:
            first = time.perf_counter()
    end = time.perf_counter()
    return start, first if first is not None else end, end


def _stats_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before.get(key, 0.0) for key in after}


async def _run_batch(
    mode: str,
    ctx: ContextWorker | None,
    gen: GenerationWorker,
    prompts: list[list[int]],
    new_tokens: int,
    tag: str,
) -> RunResult:
    workers = [w for w in (ctx, gen) if w is not None]
    before = [w.step_stats() for w in workers]
    times = await asyncio.gather(
        *[_one(ctx, gen, f"{tag}-{i}", p, new_tokens) for i, p in enumerate(prompts)]
    )
    deltas = [_stats_delta(w.step_stats(), b) for w, b in zip(workers, before, strict=True)]
    steps = sum(d["steps"] for d in deltas) or 1
    ttfts = [first - start for start, first, _ in times]
    decode_span = max(end for *_, end in times) - min(first for _, first, _ in times)
    decode_tokens = len(prompts) * (new_tokens - 1)
    return RunResult(
        mode=mode,
        batch_size=len(prompts),
        ttft_mean_s=sum(ttfts) / len(ttfts),
        ttft_max_s=max(ttfts),
        decode_tok_s=decode_tokens / decode_span if decode_span > 0 else float("nan"),
        steps=int(steps),
        schedule_build_ms=1e3 * sum(d["schedule_s"] + d["build_s"] for d in deltas) / steps,
        forward_ms=1e3 * sum(d["forward_s"] for d in deltas) / steps,
        sample_ms=1e3 * sum(d["sample_s"] for d in deltas) / steps,
    )


def _config(args: argparse.Namespace, checkpoint: Path) -> WorkerConfig:
    tokens_per_request = args.prompt_len + args.new_tokens
    return WorkerConfig(
        checkpoint=str(checkpoint),
        manager=args.manager,
        transceiver="python",
        block_size=16,
        max_tokens=max(args.batch_sizes) * tokens_per_request + 16,
        max_num_tokens=args.max_num_tokens,
        max_batch_size=max(args.batch_sizes),
        cluster_secret="engine-bench",
    )


def _print(result: RunResult) -> None:
    print(
        f"{result.mode:<11} {result.batch_size:>5} {result.ttft_mean_s:>10.3f} "
        f"{result.ttft_max_s:>9.3f} {result.decode_tok_s:>12.1f} {result.steps:>6} "
        f"{result.schedule_build_ms:>14.2f} {result.forward_ms:>11.2f} {result.sample_ms:>10.2f}",
        flush=True,
    )


async def _main(args: argparse.Namespace, checkpoint: Path) -> int:
    config = _config(args, checkpoint)
    aggregated = GenerationWorker(config, "bench-aggregated", role="aggregated")
    ctx = ContextWorker(config, "bench-context")
    gen = GenerationWorker(config, "bench-generation")
    for worker in (aggregated, ctx, gen):
        await worker.start()
    vocab = aggregated.engine.model_config.vocab_size
    print(
        f"checkpoint {checkpoint} ({aggregated.engine.model_config.architecture}), "
        f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(
        f"{'mode':<11} {'batch':>5} {'ttft_mean':>10} {'ttft_max':>9} {'decode_tok/s':>12} "
        f"{'steps':>6} {'sched+build_ms':>14} {'forward_ms':>11} {'sample_ms':>10}"
    )
    deadline = time.monotonic() + args.max_seconds
    try:
        for batch in args.batch_sizes:
            prompts = _prompts(batch, args.prompt_len, vocab, batch)
            for mode, pair in (("aggregated", (None, aggregated)), ("1p1d", (ctx, gen))):
                if time.monotonic() > deadline:
                    print(f"stopped: --max-seconds {args.max_seconds} reached")
                    return 0
                # Warm-up at this batch's shapes, untimed: first calls allocate,
                # fault in pages and build oneDNN's kernels for each new shape.
                await _run_batch(mode, pair[0], pair[1], prompts, 3, f"warm-{mode}{batch}")
                _print(
                    await _run_batch(
                        mode, pair[0], pair[1], prompts, args.new_tokens, f"{mode}{batch}"
                    )
                )
    finally:
        for worker in (aggregated, ctx, gen):
            await worker.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint", type=Path, help="checkpoint folder (default: embedded small Llama)"
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(DEFAULT_BATCH_SIZES))
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-num-tokens", type=int, default=2048)
    parser.add_argument("--manager", choices=("v1", "v2"), default="v1")
    parser.add_argument(
        "--max-seconds", type=float, default=600.0, help="stop starting new runs after this"
    )
    args = parser.parse_args(argv)
    checkpoint = args.checkpoint
    if checkpoint is None:
        from models.embedded.writer import ensure_checkpoint

        checkpoint = ensure_checkpoint(
            Path(tempfile.gettempdir()) / "disagg-bench-small-llama", "llama", "small"
        )
    return asyncio.run(_main(args, checkpoint))


if __name__ == "__main__":
    sys.exit(main())
