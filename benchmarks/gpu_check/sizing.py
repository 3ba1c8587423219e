"""Part 5: two instances sharing one GPU at `num_gpus: 0.5`, sized as workers size.

Both rows use the worker's own reckoning (`engine.cache_build.gpu_share`,
`instance_overheads`, `build_cache`), never a copy of it:

- arithmetic (any device): two instances of the `small` Llama at share 0.5,
  on an 80 GiB device whose readings follow from the reckoning itself (the
  second instance sees the first one's footprint gone from the free memory):
  both caches equal, both footprints within their share.
- on the GPU: two processes, started one after the other, each measures its
  weights (`DeviceBytesMeter`), sizes its cache from its share, allocates
  it, captures its decode graphs and runs a step at its token budget and a
  sampled decode batch; then holds. This process reads the device's free
  memory before and after each, so an instance's *measured* footprint (CUDA
  context, weights, cache, workspaces, graph pool, the step's peak, all that
  the allocator kept) is set against what its share allows. Both must run
  to the end, with no out-of-memory error, while the other holds its cache.
"""

from __future__ import annotations

import gc
import multiprocessing
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from benchmarks.gpu_check.engine_setup import checkpoint
from benchmarks.gpu_check.report import needs_cuda
from engine.worker_config import WorkerConfig

GIB, MIB = 1 << 30, 1 << 20
SHARE = 0.5
FRACTION = 0.9
MAX_NUM_TOKENS = 512
MAX_BATCH_SIZE = 8
DTYPE = "bfloat16"
_TIMEOUT_S = 240.0


def worker_config(path: Path) -> WorkerConfig:
    """A generation worker at half a GPU, its cache sized by memory_fraction."""
    return WorkerConfig(
        checkpoint=str(path),
        dtype=DTYPE,
        device="cuda",
        manager="v2",
        max_tokens=None,
        memory_fraction=FRACTION,
        gpu_share=SHARE,
        max_num_tokens=MAX_NUM_TOKENS,
        max_batch_size=MAX_BATCH_SIZE,
    )


def check_sizing(root: Path, device: str) -> list[dict[str, Any]]:
    path = checkpoint(root, "llama", "small")
    rows = [_arithmetic(path)]
    if device == "cuda":
        rows.append(_two_processes(path))
    else:
        rows.append(needs_cuda("two processes at num_gpus 0.5 on one GPU, footprints measured"))
    return rows


def _arithmetic(path: Path) -> dict[str, Any]:
    from engine.cache_build import instance_overheads
    from kvcache.device_memory import DeviceMemory
    from kvcache.gpu_share import GpuShare
    from kvcache.sizing import size_instance_cache
    from models.hf_config import load_model_config

    config = worker_config(path)
    model = load_model_config(path)
    overheads = instance_overheads(config, model)
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    spec = model.cache_spec(DTYPE)
    total, used, caches = 80 * GIB, 0, []
    for _ in range(2):
        used += overheads.reserve.cuda_context + weights
        share = GpuShare(DeviceMemory(total, total - used, weights), SHARE, FRACTION, overheads)
        sizing = size_instance_cache(
            spec,
            block_size=config.block_size,
            model_len=model.max_position_embeddings,
            max_batch_size=MAX_BATCH_SIZE,
            gpu_share=share,
        )
        used += sizing.total_bytes + overheads.after_cache
        caches.append(sizing.total_bytes)
    return {
        "check": "two instances at num_gpus 0.5: sizing arithmetic on an 80 GiB device",
        "cache_mib": [round(c / MIB, 1) for c in caches],
        "overheads_mib": round(overheads.total / MIB, 1),
        "largest_peak": overheads.peaks.largest_name(),
        "used_of_total": used / total,
        "ok": caches[0] == caches[1] and used <= FRACTION * total,
    }


def _two_processes(path: Path) -> dict[str, Any]:
    import torch

    ctx = multiprocessing.get_context("spawn")
    # What the earlier parts left in this process's allocator goes back first.
    gc.collect()
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info()
    instances, pipes, reports = [], [], []
    try:
        for _ in range(2):
            ours, theirs = ctx.Pipe()
            process = ctx.Process(target=_serve_half, args=(theirs, path), daemon=True)
            process.start()
            instances.append(process)
            pipes.append(ours)
            if not ours.poll(_TIMEOUT_S):
                raise TimeoutError(f"an instance did not report within {_TIMEOUT_S:.0f} s")
            report = ours.recv()
            if "error" in report:
                raise RuntimeError(f"instance {len(instances)}: {report['error']}")
            free_after, _ = torch.cuda.mem_get_info()
            report["measured_mib"] = (free_before - free_after) / MIB
            report["share_mib"] = SHARE * FRACTION * total / MIB
            reports.append(report)
            free_before = free_after
    finally:
        for pipe in pipes:
            pipe.send("exit")
        for process in instances:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return {
        "check": "two processes at num_gpus 0.5 on one GPU, footprints measured",
        "measured_mib": [round(r["measured_mib"], 1) for r in reports],
        "budgeted_mib": [round(r["budgeted_mib"], 1) for r in reports],
        "share_mib": round(reports[0]["share_mib"], 1),
        "weights_mib": [round(r["weights_mib"], 1) for r in reports],
        "cache_mib": [round(r["cache_mib"], 1) for r in reports],
        "allocator_peak_mib": [round(r["allocator_peak_mib"], 1) for r in reports],
        "graph_replays": [r["graph_replays"] for r in reports],
        # Within its share, with its decode steps replayed from graphs (their
        # pool allocated) while the other instance held its cache.
        "ok": all(r["measured_mib"] <= r["share_mib"] and r["graph_replays"] > 0 for r in reports),
    }


def _serve_half(pipe: Connection, path: Path) -> None:
    """One instance: measure, size, allocate, capture, run; report; hold until told."""
    try:
        pipe.send(_run_instance(path))
    except Exception as error:  # reported to the parent, which fails the row
        pipe.send({"error": f"{type(error).__name__}: {error}"})
    pipe.recv()


def _run_instance(path: Path) -> dict[str, Any]:
    import torch

    from engine.cache_build import build_cache, gpu_share
    from engine.model_runner import ModelRunner
    from engine.sampling import Sampler
    from kvcache.device_memory import DeviceBytesMeter
    from models.loader import load_model

    config = worker_config(path)
    with DeviceBytesMeter("cuda") as weights:
        model, model_config = load_model(path, dtype=DTYPE, device="cuda")
    assert weights.bytes is not None
    share = gpu_share(config, model_config, weights.bytes)
    assert share is not None
    manager, cache, sizing = build_cache(config, model_config, gpu_share=share)
    runner = ModelRunner(model, cache.views(), manager, config.block_size, Sampler(), device="cuda")
    replays = run_steps(runner, manager, config.block_size, model_config.max_position_embeddings)
    torch.cuda.synchronize()
    return {
        "weights_mib": weights.bytes / MIB,
        "cache_mib": sizing.total_bytes / MIB,
        "budgeted_mib": (weights.bytes + sizing.total_bytes + share.overheads.total) / MIB,
        "allocator_peak_mib": torch.cuda.max_memory_reserved() / MIB,
        "graph_replays": replays,
    }


def run_steps(runner: Any, manager: Any, block_size: int, model_len: int) -> int:
    """Warm up (graphs captured on CUDA), then a first step at the token budget
    and sampled decode steps of the whole batch: an instance's peaks. Returns
    the decode steps replayed from CUDA graphs."""
    from engine.core import EngineCore
    from engine.decode_graphs import graph_batch_sizes
    from engine.request import Request
    from engine.sampling import SamplingParams
    from engine.scheduler import Scheduler, SchedulerConfig

    longest = min(model_len, manager.num_usable_blocks * block_size)
    runner.prepare(-(-longest // block_size), graph_batch_sizes(MAX_BATCH_SIZE))
    scheduler = Scheduler(SchedulerConfig(MAX_NUM_TOKENS, MAX_BATCH_SIZE, longest), manager)
    core = EngineCore(scheduler, runner, make_stop_check=lambda _: _never)
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=1, ignore_eos=True)
    prompt = MAX_NUM_TOKENS // MAX_BATCH_SIZE
    for i in range(MAX_BATCH_SIZE):
        core.add(Request(f"r{i}", [3 + (i + j) % 100 for j in range(prompt)], params))
    for _ in range(4):
        core.step()
    return runner.graphs.num_replays if runner.graphs is not None else 0


def _never(request: Any) -> None:
    """No request stops: the instance runs exactly the steps asked for."""
    return None
