"""Build everything a worker runs from its `WorkerConfig`.

One `EngineInstance` per actor: the model and tokenizer, the KV cache manager
(V1 or V2) with its pool tensors, the model runner, the engine core and the
asyncio loop that drives it. The three worker kinds differ only in `role`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.cache_build import build_cache, gpu_share
from engine.core import EngineCore, StopCheck
from engine.decode_graphs import graph_batch_sizes
from engine.grammar import GrammarBook
from engine.image_encoder import ImageEncoder, VisionModel
from engine.loop import EngineLoop
from engine.messages import KVEventBatch, RankCacheUsage, WorkerIntegrity, WorkerLoad
from engine.model_runner import ModelRunner
from engine.request import FinishReason, Request
from engine.sampling import Sampler
from engine.scheduler import Scheduler, SchedulerConfig
from engine.speculation.drafts import Drafter
from engine.speculation.mtp import MTPDrafting, mtp_drafting
from engine.step_timeline import StepRecord
from engine.stop import StopChecker
from engine.tensor_parallel import RankCapacity, RankGroup
from engine.worker_config import WorkerConfig
from kvcache.device_memory import DeviceBytesMeter
from kvcache.errors import IntegrityError
from kvcache.manager import KVCacheManager
from kvcache.tensors import CacheTensors
from models.base import CausalLM
from models.config import ModelConfig, TensorParallelShard
from models.image_processing import load_image_processor_config
from models.loader import load_model
from models.tokenizer import Tokenizer, load_tokenizer
from transfer.base import Transceiver

logger = logging.getLogger(__name__)

ROLES = ("context", "generation", "aggregated")


@dataclass
class EngineInstance:
    config: WorkerConfig
    role: str
    worker_id: str
    model: CausalLM
    model_config: ModelConfig
    tokenizer: Tokenizer
    manager: KVCacheManager
    cache: CacheTensors
    runner: ModelRunner
    core: EngineCore
    loop: EngineLoop
    ranks: RankGroup | None = None  # ranks 1.. of a tensor-parallel instance
    node_ip: str = ""  # the Ray node of this process, "" outside Ray

    @classmethod
    def build(cls, config: WorkerConfig, role: str, worker_id: str) -> EngineInstance:
        if role not in ROLES:
            raise ValueError(f"worker role must be one of {ROLES}, got {role!r}")
        # Wherever Ray started this process; the other ranks share its node
        # (one STRICT_PACK placement group) and get the resolved settings.
        config = config.on_this_node(worker_id)
        num_ranks = config.tensor_parallel_size
        speculative = config.speculative
        use_mtp = speculative is not None and speculative.uses_model
        with DeviceBytesMeter(config.device) as weights:
            model, model_config = load_model(
                Path(config.checkpoint),
                dtype=config.dtype,
                device=config.device,
                tp=TensorParallelShard(0, num_ranks),
                use_mtp=use_mtp,
            )
        tokenizer = load_tokenizer(config.checkpoint)
        share = gpu_share(config, model_config, weights.bytes)
        manager, cache, sizing = build_cache(config, model_config, gpu_share=share)
        ranks = RankGroup.start(config, worker_id, sizing) if num_ranks > 1 else None
        spec = model_config.cache_spec(config.dtype)
        eos = model_config.eos_token_ids or tokenizer.eos_token_ids
        runner = ModelRunner(
            model,
            cache.views(),
            manager,
            config.block_size,
            Sampler(),
            device=config.device,
            is_hybrid=spec.is_hybrid,
            image_encoder=_build_image_encoder(config, model, model_config),
            followers=ranks,
            mtp=_build_mtp(config, model) if use_mtp else None,
            grammars=GrammarBook(tokenizer, model_config.vocab_size, eos),
        )
        # No sequence grows past the checkpoint's context or the whole cache.
        capacity = manager.num_usable_blocks * config.block_size
        longest = min(model_config.max_position_embeddings, capacity)
        # Context workers prefill: their few decode steps are not worth graphs.
        # Graphs do not capture the other ranks' steps of a tensor-parallel instance.
        with_graphs = role != "context" and ranks is None
        sizes = graph_batch_sizes(config.max_batch_size) if with_graphs else ()
        runner.prepare(-(-longest // config.block_size), sizes)
        # Drafts are verified where requests decode: a context worker samples
        # only the first token (with MTP it drafts after it, for the
        # generation worker's first verify).
        verifies = speculative is not None and role != "context"
        drafter = Drafter(speculative) if verifies and speculative is not None else None
        core = EngineCore(
            _build_scheduler(config, manager, drafter),
            runner,
            make_stop_check=lambda req: _stop_check(req, eos, tokenizer),
            context_only=role == "context",
            drafter=drafter,
        )
        return cls(
            config=config,
            role=role,
            worker_id=worker_id,
            model=model,
            model_config=model_config,
            tokenizer=tokenizer,
            manager=manager,
            cache=cache,
            runner=runner,
            core=core,
            loop=EngineLoop(core),
            ranks=ranks,
            node_ip=_ray_node_ip(),
        )

    def create_transceiver(self) -> Transceiver:
        """The transceiver over this instance's cache, as its resolved
        `cache_transceiver` settings name it (one per worker)."""
        return self.config.create_transceiver(self.cache.buffers(), self.worker_id)

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel instance (none otherwise)."""
        if self.ranks is not None:
            self.ranks.close()

    def load(self, num_transferring: int) -> WorkerLoad:
        sched = self.core.scheduler
        in_flight = sum(r.num_tokens for r in (*sched.waiting, *sched.running))
        encoder = self.runner.image_encoder
        return WorkerLoad(
            worker_id=self.worker_id,
            role=self.role,
            num_waiting=len(sched.waiting),
            num_running=len(sched.running),
            num_transferring=num_transferring,
            num_free_blocks=self.manager.num_free_blocks,
            num_total_blocks=self.manager.num_usable_blocks,
            num_free_mamba_slots=(
                self.manager.mamba_pool.num_free_slots if self.manager.mamba_pool else 0
            ),
            num_tokens_in_flight=in_flight,
            encoder_cache_hits=encoder.stats.hits if encoder is not None else 0,
            encoder_cache_misses=encoder.stats.misses if encoder is not None else 0,
            **self._snapshot_load(),
            **self._speculation_load(),
            ranks=self.rank_cache_usage(),
            num_steps=self.loop.stats.steps,
            step_busy_s=self.loop.stats.busy_s,
            step_in_flight_s=self.loop.step_in_flight_s,
            node_ip=self.node_ip,
        )

    def _snapshot_load(self) -> dict[str, Any]:
        reuse = self.manager.hybrid_reuse
        if reuse is None:
            return {}
        store = reuse.store
        return {
            "snapshot_hits": store.hits,
            "snapshot_misses": store.misses,
            "snapshot_evictions": store.evictions,
            "snapshot_drops": store.dropped,
            "snapshot_resumed_tokens": reuse.resumed_tokens,
            "num_snapshots": len(store),
            "num_snapshot_slots": store.capacity,
        }

    def _speculation_load(self) -> dict[str, Any]:
        drafter = self.core.drafter
        if drafter is None:
            return {}
        stats = drafter.stats
        return {
            "spec_verifies": stats.verifies,
            "spec_drafted": stats.drafted,
            "spec_accepted": stats.accepted,
            "spec_drafted_at": tuple(stats.drafted_at),
            "spec_accepted_at": tuple(stats.accepted_at),
        }

    def rank_cache_usage(self) -> tuple[RankCacheUsage, ...]:
        """Each rank's cache and what of it is in use: rank 0's manager counts
        for all of them (block ids and slots are its own on every rank)."""
        manager, pool = self.manager, self.manager.mamba_pool
        capacities = [RankCapacity.of(manager), *(self.ranks.capacities if self.ranks else [])]
        used_blocks = manager.num_usable_blocks - manager.num_free_blocks
        used_slots = pool.num_slots - pool.num_free_slots if pool is not None else 0
        return tuple(
            RankCacheUsage(rank, c.num_blocks, used_blocks, c.num_mamba_slots, used_slots)
            for rank, c in enumerate(capacities)
        )

    def integrity(self, num_in_transfer: int, num_pinned: int) -> WorkerIntegrity:
        """The cache manager's integrity and free counts; call between steps
        (`EngineLoop.run_between_steps`) so no step mutates them meanwhile."""
        try:
            self.manager.check_integrity()
            problems: list[str] = []
        except IntegrityError as error:
            problems = list(error.problems)
        sched = self.core.scheduler
        mamba = self.manager.mamba_pool
        return WorkerIntegrity(
            worker_id=self.worker_id,
            ok=not problems,
            problems=problems,
            num_free_blocks=self.manager.num_free_blocks,
            num_usable_blocks=self.manager.num_usable_blocks,
            num_free_mamba_slots=mamba.num_free_slots if mamba else 0,
            num_mamba_slots=mamba.num_slots if mamba else 0,
            num_requests=len(sched.waiting) + len(sched.running) + num_in_transfer,
            num_pinned=num_pinned,
        )

    def drain_kv_events(self) -> KVEventBatch:
        encoder = self.runner.image_encoder
        return KVEventBatch(
            worker_id=self.worker_id,
            events=list(self.manager.drain_events()),
            encoder_events=encoder.drain_events() if encoder is not None else [],
            snapshot_events=self.manager.drain_snapshot_events(),
        )

    def step_timeline(self) -> list[StepRecord]:
        """The loop's recent steps, oldest first (`engine.step_timeline`)."""
        return list(self.loop.timeline.records)

    def step_stats(self) -> dict[str, float]:
        """The loop's step counters, plus the encoder cache's for a VL model."""
        stats = dict(vars(self.loop.stats))
        encoder = self.runner.image_encoder
        if encoder is not None:
            stats["encoder_cache_hits"] = encoder.stats.hits
            stats["encoder_cache_misses"] = encoder.stats.misses
        return stats


def _build_image_encoder(
    config: WorkerConfig, model: CausalLM, model_config: ModelConfig
) -> ImageEncoder | None:
    """The vision path of a VL model with its preprocessing settings; None for
    text-only models (a generation worker builds one too: in aggregated mode
    and under conditional disaggregation it prefills images itself)."""
    if model_config.vision is None or not isinstance(model, VisionModel):
        return None
    processing = load_image_processor_config(Path(config.checkpoint), model_config.vision)
    return ImageEncoder(model, processing, torch.device(config.device))


def _build_mtp(config: WorkerConfig, model: CausalLM) -> MTPDrafting:
    """The model's MTP layers as the runner's drafter (`engine.speculation.mtp`)."""
    assert config.speculative is not None
    k = config.speculative.num_speculative_tokens
    return mtp_drafting(model, k, config.block_size, config.device)


def _build_scheduler(
    config: WorkerConfig, manager: KVCacheManager, drafter: Drafter | None = None
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_tokens=config.max_num_tokens,
            max_batch_size=config.max_batch_size,
            max_model_tokens=manager.num_usable_blocks * config.block_size,
            enable_prefix_match=manager.enable_block_reuse,
            max_num_waiting=config.max_num_waiting,
        ),
        manager,
        drafter,
    )


def _stop_check(request: Request, eos: tuple[int, ...], tokenizer: Tokenizer) -> StopCheck:
    """A per-request stop decision over its output tokens.

    Tokens are fed to the `StopChecker` in order, each once; a request pulled
    from a context worker arrives with its first token already in
    `output_token_ids`, and that token is fed with the next call. Text is
    detokenized only when the request has stop strings.
    """
    params = request.params
    checker = StopChecker(params, eos)
    detok = tokenizer.detokenizer(request.prompt_token_ids) if params.stop else None
    fed = 0

    def check(req: Request) -> FinishReason | None:
        nonlocal fed
        outputs = req.output_token_ids
        while fed < len(outputs):
            token = outputs[fed]
            fed += 1
            decision = checker.check(token, detok.push(token) if detok is not None else "")
            if decision.finished:
                return FinishReason.LENGTH if decision.reason == "length" else FinishReason.STOP
        return None

    return check


def _ray_node_ip() -> str:
    """The address of the Ray node running this process ("" outside Ray):
    after Ray restarts a worker on another node, its load reports say so."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else ""
