"""One engine's steps on different thread counts, alternating in one process.

Builds our aggregated engine on a checkpoint, prefills `--batch-size`
prompts of `--prompt-len` random token ids, then runs decode steps of that
batch, switching torch's thread count step by step over `--threads` (1 2 1 2
...), so load from other processes on a shared machine hits every count
alike. Per count it prints a decode step's wall time (p50 and mean), its
CPU time (all threads of the process), and how many times the process's
other threads went to sleep per step: with passive OpenMP waits
(`OMP_WAIT_POLICY=PASSIVE` in its environment) that is the number of
parallel regions the team joined, each paying a wake-up. The prefill of
the batch is timed on every count too (best of two). It runs in the
environment served CPU workers start with (`engine.process_env`),
re-executing itself if needed.

    python -m benchmarks.thread_counts --model smollm2 --batch-size 1 --threads 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.vllm_compare import make_prompts
from engine.core import EngineCore
from engine.instance import EngineInstance
from engine.process_env import run_in_cpu_engine_env
from engine.request import Request
from engine.sampling import SamplingParams
from engine.threads import run_on_compute_thread
from engine.worker_config import WorkerConfig

WARM_STEPS = 10
PREFILL_REPEATS = 2
BLOCK_SIZE = 16


@dataclass
class CountResult:
    threads: int
    step_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    sleeps: list[int] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)

    def line(self) -> str:
        return (
            f"{self.threads:>2} threads: decode step p50 {1e3 * statistics.median(self.step_s):6.2f} "
            f"ms, mean {1e3 * statistics.mean(self.step_s):6.2f} ms, CPU "
            f"{1e3 * statistics.median(self.cpu_s):6.2f} ms, other threads asleep "
            f"{statistics.median(self.sleeps):4.0f} times/step; prefill "
            f"{1e3 * min(self.prefill_s):7.1f} ms"
        )


def _sleeps_per_thread() -> dict[int, int]:
    """Voluntary context switches of every thread of this process."""
    counts: dict[int, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as status:
                for line in status:
                    if line.startswith("voluntary_ctxt_switches"):
                        counts[int(tid)] = int(line.split()[1])
        except FileNotFoundError:  # a thread that just ended
            continue
    return counts


def _timed_step(core: EngineCore, result: CountResult) -> None:
    me = threading.get_native_id()
    before, cpu, start = _sleeps_per_thread(), time.process_time(), time.perf_counter()
    core.step()
    result.step_s.append(time.perf_counter() - start)
    result.cpu_s.append(time.process_time() - cpu)
    after = _sleeps_per_thread()
    result.sleeps.append(sum(n - before.get(t, n) for t, n in after.items() if t != me))


def _prefill(core: EngineCore, prompts: list[list[int]], tag: str) -> float:
    one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add(Request(f"{tag}-{i}", list(prompt), one_token))
    start = time.perf_counter()
    while core.has_work():
        core.step()
    return time.perf_counter() - start


def _whole_blocks(tokens: int) -> int:
    """`tokens` rounded up to whole cache blocks."""
    return -(-tokens // BLOCK_SIZE) * BLOCK_SIZE


def measure(args: argparse.Namespace, checkpoint: Path) -> list[CountResult]:
    """The alternating runs, on the compute thread where workers step."""
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args.batch_size, args.prompt_len, vocab, seed=1)
    new_tokens = WARM_STEPS + args.steps * len(args.threads) + 1
    config = WorkerConfig(
        checkpoint=str(checkpoint),
        dtype=args.dtype,
        manager="v1",
        block_size=BLOCK_SIZE,
        max_tokens=args.batch_size * _whole_blocks(args.prompt_len + new_tokens),
        max_num_tokens=max(2048, args.batch_size * args.prompt_len),
        max_batch_size=args.batch_size,
        cluster_secret="thread-counts",
    )
    results = [CountResult(n) for n in args.threads]

    def run() -> None:
        before = torch.get_num_threads()
        instance = EngineInstance.build(config, "aggregated", "thread-counts")
        core = instance.core
        try:
            for repeat in range(PREFILL_REPEATS):
                for result in results:
                    torch.set_num_threads(result.threads)
                    result.prefill_s.append(_prefill(core, prompts, f"p{repeat}-{result.threads}"))
            params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            for i, prompt in enumerate(prompts):
                core.add(Request(f"d-{i}", list(prompt), params))
            for _ in range(WARM_STEPS):
                core.step()
            for _ in range(args.steps):
                for result in results:
                    torch.set_num_threads(result.threads)
                    _timed_step(core, result)
        finally:
            instance.close()
            torch.set_num_threads(before)  # the compute thread serves other callers too

    run_on_compute_thread(run)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local HF folder, or 'smollm2' (default: the anchor)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per count")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    run_in_cpu_engine_env(__spec__.name, argv)
    from benchmarks.serve_compare import resolve_model

    checkpoint = resolve_model(args.model)
    print(f"{checkpoint.name}, batch {args.batch_size}, prompt {args.prompt_len} tokens")
    for result in measure(args, checkpoint):
        print("  " + result.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
