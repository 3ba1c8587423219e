"""What every part of the GPU check builds: checkpoints and an engine core.

The engine core is the one the workers run (scheduler, model runner,
sampler), built here without a worker, Ray or a config file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.core import EngineCore
from engine.model_runner import ModelRunner
from engine.request import FinishReason, Request
from engine.sampling import Sampler, SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from kvcache.factory import create_manager
from kvcache.manager import KVCacheManager
from models.base import CausalLM
from models.config import ModelConfig
from models.embedded.writer import write_checkpoint
from models.loader import load_model

# Large enough that logits are not flat, so greedy choices are not near ties.
INITIALIZER_RANGE = 0.1
OMNI = "NemotronH_Omni_Reasoning_V3"


def checkpoint(root: Path, arch: str, size: str) -> Path:
    """An embedded checkpoint under `root`, written once per (arch, size)."""
    out = root / f"{arch}-{size}"
    if not (out / "embedded_checkpoint.json").exists():
        vl = OMNI if arch == "nemotron_vl" else None
        write_checkpoint(
            out, arch, size, seed=0, vl_architecture=vl, initializer_range=INITIALIZER_RANGE
        )
    return out


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@dataclass
class Engine:
    model: CausalLM
    config: ModelConfig
    manager: KVCacheManager
    runner: ModelRunner
    core: EngineCore


def build_engine(
    path: Path,
    device: str,
    dtype: str,
    *,
    num_blocks: int,
    block_size: int = 16,
    max_num_tokens: int = 512,
    max_batch_size: int = 8,
    graph_batch_sizes: tuple[int, ...] = (),
) -> Engine:
    """Model, V2 cache of `num_blocks` blocks, runner (warmed up, graphs
    captured for `graph_batch_sizes` on CUDA) and engine core."""
    from kvcache.tensors import allocate_cache_tensors

    model, config = load_model(path, dtype=dtype, device=device)
    spec = config.cache_spec(dtype)
    manager = create_manager("v2", spec, num_blocks, block_size, max_batch_size)
    cache = allocate_cache_tensors(manager, device)
    runner = ModelRunner(
        model,
        cache.views(),
        manager,
        block_size,
        Sampler(),
        device=device,
        is_hybrid=spec.is_hybrid,
    )
    max_blocks = -(-min(config.max_position_embeddings, num_blocks * block_size) // block_size)
    runner.prepare(max_blocks, graph_batch_sizes)
    scheduler = Scheduler(
        SchedulerConfig(max_num_tokens, max_batch_size, manager.num_usable_blocks * block_size),
        manager,
    )
    core = EngineCore(scheduler, runner, make_stop_check=lambda _: _stop_at_max_tokens)
    return Engine(model, config, manager, runner, core)


def _stop_at_max_tokens(request: Request) -> FinishReason | None:
    if len(request.output_token_ids) >= request.params.max_tokens:
        return FinishReason.LENGTH
    return None


def run_to_completion(engine: Engine, requests: list[Request]) -> tuple[dict[str, list[int]], int]:
    """Submit `requests`, step until all finish; (tokens per request, preemptions)."""
    for request in requests:
        engine.core.add(request)
    preempted = 0
    while engine.core.has_work():
        preempted += engine.core.step().num_preempted
    return {r.request_id: list(r.output_token_ids) for r in requests}, preempted


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
