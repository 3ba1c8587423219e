"""Time to the first generated token of long prompts through the router, with
and without chunk-pipelined transfer.

1P1D in two processes: a context worker and a generation worker, each a Ray
actor with one CPU, and the router of `disagg serve` in this process. Every
request is a fresh random prompt (nothing is served from a cache) with 2 new
tokens. The first token comes from the context worker and reaches the caller
before the cache moves; the second is the first one the generation worker
computes, so it waits for the whole cache. "2nd" below is the time from
`Router.generate` to that second token: the latency the transfer adds to.
The two settings alternate request by request on the same workers, so both
see the same machine:

- pipelined: the generation worker pulls each finished prefill chunk's
  blocks while the context worker computes the next chunks, then the tail;
- whole: one pull after the prefill (`cache_transceiver.pipelined_transfer: false`).

    python -m benchmarks.pipelined_ttft --prompt-len 2048 --chunk 512 --requests 8
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import torch

from cluster.launch.launcher import init_local_ray
from cluster.metrics import ServingMetrics
from cluster.routing.policies import WorkerState
from cluster.routing.router import Router, RoutingSettings
from cluster.routing.worker_poller import WorkerEndpoint
from decode_worker.worker import GenerationWorker
from engine.sampling import SamplingParams
from engine.worker_config import WorkerConfig
from prefill_worker.worker import ContextWorker

BLOCK_SIZE = 16


def _config(args: argparse.Namespace, checkpoint: Path, role: str) -> WorkerConfig:
    return WorkerConfig(
        checkpoint=str(checkpoint),
        manager=args.manager,
        transceiver=args.transceiver,
        block_size=BLOCK_SIZE,
        max_tokens=2 * (args.prompt_len + 16),
        max_num_tokens=args.chunk if role == "context" else 2048,
        max_batch_size=4,
        cluster_secret="pipelined-ttft",
    )


def _router(ctx: Any, gen: Any) -> Router:
    settings = RoutingSettings(
        policy="round_robin",
        max_local_prefill_length=0,
        context_block_size=BLOCK_SIZE,
        generation_block_size=BLOCK_SIZE,
    )
    return Router(
        [WorkerEndpoint("context-0", ctx, WorkerState("context-0"))],
        [WorkerEndpoint("generation-0", gen, WorkerState("generation-0"))],
        settings,
        ServingMetrics(),
    )


async def _ttft(router: Router, rid: str, prompt: list[int]) -> tuple[float, float]:
    """(time to the second token, the part of it after the context worker
    sampled the first token)."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    sampled: float | None = None
    async for event in router.generate(rid, prompt, params):
        if event.error is not None:
            raise RuntimeError(event.error)
        if sampled is None:
            # The first event carries the context worker's wall-clock sampling
            # time; both processes share this machine's clock.
            sampled = event.timestamp
        elif event.token_ids:
            return time.perf_counter() - start, time.time() - sampled
    raise RuntimeError(f"request {rid!r} ended before its second token")


async def _run(args: argparse.Namespace, ctx: Any, gen: Any, vocab: int) -> int:
    # One router (a generation worker streams its events to one reader); the
    # setting is what `pipelined_transfer` turns into at startup.
    router = _router(ctx, gen)
    settings = {
        "pipelined": dataclasses.replace(router.settings, pipeline_above_tokens=args.chunk),
        "whole": dataclasses.replace(router.settings, pipeline_above_tokens=None),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in settings}
    rng = torch.Generator().manual_seed(args.seed)
    try:
        for i in range(args.warmup + args.requests):
            # Alternate which setting goes first, so neither always follows the other.
            order = list(settings) if i % 2 == 0 else list(settings)[::-1]
            for name in order:
                router.settings = settings[name]
                prompt = torch.randint(10, vocab, (args.prompt_len,), generator=rng).tolist()
                measured = await _ttft(router, f"{name}-{i}", prompt)
                if i >= args.warmup:
                    times[name].append(measured)
        stats = await gen.step_stats.remote()
    finally:
        await router.stop()
    _report(args, times, int(stats["pipelined_blocks"]))
    return 0


def _report(
    args: argparse.Namespace, times: dict[str, list[tuple[float, float]]], pipelined_blocks: int
) -> None:
    print(
        f"1P1D {args.transceiver} transceiver, {args.manager}, prompt {args.prompt_len} tokens, "
        f"context chunk (max_num_tokens) {args.chunk}, block size {BLOCK_SIZE}, "
        f"{args.requests} requests per setting after {args.warmup} warm-up"
    )
    print(
        f"{'setting':<10} {'2nd_p50_ms':>12} {'2nd_min_ms':>12} "
        f"{'to_first_token_p50_ms':>22} {'after_prefill_p50_ms':>21}"
    )
    p50 = {}
    for name, values in times.items():
        ttfts, tails = [t for t, _ in values], [t for _, t in values]
        prefills = [t - tail for t, tail in values]
        p50[name] = (statistics.median(ttfts), statistics.median(tails))
        print(
            f"{name:<10} {1e3 * p50[name][0]:>12.1f} {1e3 * min(ttfts):>12.1f} "
            f"{1e3 * statistics.median(prefills):>22.1f} {1e3 * p50[name][1]:>21.1f}"
        )
    # Requests of the two settings ran in adjacent pairs: the median of the
    # pairs' ratios is less sensitive to load that drifts during the run.
    paired = statistics.median(
        p / w for (p, _), (w, _) in zip(times["pipelined"], times["whole"], strict=True)
    )
    print(
        f"pipelined / whole: 2nd token p50 {p50['pipelined'][0] / p50['whole'][0]:.3f}, "
        f"2nd token paired median {paired:.3f}, "
        f"after-prefill p50 {p50['pipelined'][1] / p50['whole'][1]:.3f}"
    )
    print(f"blocks pulled while their prompt prefilled: {pipelined_blocks}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint", type=Path, help="checkpoint folder (default: embedded small Llama)"
    )
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512, help="context max_num_tokens")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--transceiver", choices=("python", "nixl"), default="python")
    parser.add_argument("--manager", choices=("v1", "v2"), default="v1")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    checkpoint = args.checkpoint
    if checkpoint is None:
        from models.embedded.writer import ensure_checkpoint

        checkpoint = ensure_checkpoint(
            Path(tempfile.gettempdir()) / "disagg-bench-small-llama", "llama", "small"
        )
    init_local_ray(2, log_to_driver=False)
    try:
        ctx = (
            ray.remote(ContextWorker)
            .options(num_cpus=1)
            .remote(_config(args, checkpoint, "context"), "context-0")
        )
        gen = (
            ray.remote(GenerationWorker)
            .options(num_cpus=1)
            .remote(_config(args, checkpoint, "generation"), "generation-0")
        )
        ray.get([ctx.start.remote(), gen.start.remote()])
        vocab = _vocab(checkpoint)
        try:
            return asyncio.run(_run(args, ctx, gen, vocab))
        finally:
            ray.get([ctx.shutdown.remote(), gen.shutdown.remote()])
    finally:
        ray.shutdown()


def _vocab(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / "config.json").read_text())["vocab_size"])


if __name__ == "__main__":
    sys.exit(main())
