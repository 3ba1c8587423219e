"""The ranks of a tensor-parallel instance.

Rank 0 is the worker actor itself: it runs everything a one-rank worker runs
(scheduler, cache manager, transceiver, sampling) over its own shard of the
model. Ranks 1.. are `TensorParallelRank` actors it starts in its own
placement group, one bundle per rank. Each holds its shard of the model
(`models.tensor_parallel`) and a cache of its own KV heads sized like rank
0's, so block ids, block tables and Mamba slots, all rank 0's, mean the same
on every rank.

    rank 0 (worker)                         rank r (TensorParallelRank)
    schedule -> StepInput --run_step------> StepInput
    forward on shard 0  <== all-reduce ==>  forward on shard r
    logits (all-gather) <===============>   logits (dropped)
    sample

Each step's `StepInput` (its index lists packed in one array, which
pickles as one buffer) goes to the other ranks by one Ray actor call per
rank, sent before rank 0's own forward; a rank actor runs its calls one at
a time, in order. A call rather than a broadcast collective:
an idle instance then waits inside no collective, which would time out.
The collectives inside the model tie the ranks' steps together. A rank that
dies makes the next collective fail on the others, so rank 0's step fails;
rank 0 then exits (`RankGroup.abandon`) and Ray restarts the instance with
fresh ranks, as for any dead worker; rank 0 owns the rank actors, so they go
down with it.

The ranks of an instance form one torch.distributed group, gloo on CPU and
NCCL on CUDA, which rank 0 sets up on a free port of its node.

Each rank moves its own cache bytes (`engine.rank_transfer`): a context
instance's result carries one handle per rank, and every rank of a
generation instance pulls its heads from every context rank.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import logging
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torch.distributed import DistNetworkError

from engine.cache_build import build_cache
from engine.model_runner import ModelRunner, StepInput
from engine.process_env import inherited_worker_env
from engine.rank_transfer import RankTransfer
from engine.speculation.mtp import KeptChunk, mtp_drafting
from engine.threads import configure_torch_threads, run_on_compute_thread
from engine.worker_config import WorkerConfig
from kvcache.layout import RequestRegions
from kvcache.manager import KVCacheManager
from kvcache.sizing import CacheSizing
from kvcache.tensors import CacheTensors
from models.config import TensorParallelShard
from models.loader import load_model
from transfer.handle import TransferHandle

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How long a rank waits for the others to join the group, and for one
# collective of a step.
GROUP_TIMEOUT_S = 300.0
# How long rank 0 waits for the other ranks to leave the group on close.
LEAVE_TIMEOUT_S = 30.0
# Transfers a rank runs at once, beside its steps (a Ray concurrency group).
TRANSFER_CONCURRENCY = 16
# Tries at setting up the group: the free port rank 0 picks can be taken by
# another process before the group's store binds it.
_JOIN_ATTEMPTS = 3


def join_group(address: str, rank: int, size: int, device: str) -> None:
    """Join the instance's process group at `address` ("host:port") as `rank`.

    On CUDA the group is NCCL's, bound to this process's device (each rank
    sees only its own GPU), so its communicator is set up here, with all
    ranks, rather than guessed from the rank number at a first collective."""
    cuda = device.startswith("cuda")
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://{address}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
        device_id=_cuda_device(device) if cuda else None,
    )


def _cuda_device(device: str) -> torch.device:
    """`device` with its index ("cuda" is the current device)."""
    named = torch.device(device)
    return named if named.index is not None else torch.device("cuda", torch.cuda.current_device())


def _start_ranks(
    config: WorkerConfig, worker_id: str, sizing: CacheSizing, address: str
) -> list[Any]:
    """Actors of ranks 1.., each in its bundle of the caller's placement group
    (if any), joining the group at `address`."""
    # Unnamed: a restarted rank 0 must not meet its old ranks' names, nor
    # another deployment's on a shared Ray cluster.
    make_remote: Any = ray.remote  # its stubs do not list concurrency_groups
    actor: Any = make_remote(concurrency_groups={"transfer": TRANSFER_CONCURRENCY})(
        TensorParallelRank
    )
    group = get_current_placement_group()
    resources = ray.get_runtime_context().get_assigned_resources()
    # The other ranks run with the niceness, OpenMP and malloc settings rank 0 was given.
    env = inherited_worker_env()
    return [
        actor.options(
            num_cpus=resources.get("CPU", 1.0),
            num_gpus=resources.get("GPU", 0.0),
            runtime_env={"env_vars": env},
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=rank
            )
            if group is not None
            else None,
        ).remote(config, rank, address, sizing, f"{worker_id}-rank{rank}")
        for rank in range(1, config.tensor_parallel_size)
    ]


def _wait_for(refs: Sequence[ray.ObjectRef[T]], timeout_s: float | None = None) -> list[T]:
    """The values of `refs`, waited for on the calling thread; raises the
    first error among them, or `TimeoutError` past `timeout_s`.

    Rank 0 waits on its compute thread, never on its event loop: `ray.get`
    there would still make Ray warn about blocking an async actor's loop.
    """
    futures = [ref.future() for ref in refs]
    _, pending = concurrent.futures.wait(futures, timeout_s)
    if pending:
        raise TimeoutError(
            f"{len(pending)} of {len(futures)} ranks did not answer in {timeout_s} s"
        )
    return [future.result() for future in futures]


def _free_address(host: str) -> str:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return f"{host}:{sock.getsockname()[1]}"


@dataclass(frozen=True)
class RankCapacity:
    """How many KV blocks and Mamba slots one rank's cache holds."""

    num_blocks: int
    num_mamba_slots: int

    @classmethod
    def of(cls, manager: KVCacheManager) -> RankCapacity:
        pool = manager.mamba_pool
        return cls(manager.num_usable_blocks, pool.num_slots if pool is not None else 0)


class TensorParallelRank:
    """Rank `rank` >= 1 of a tensor-parallel instance (run as a Ray actor)."""

    def __init__(
        self, config: WorkerConfig, rank: int, address: str, sizing: CacheSizing, name: str
    ) -> None:
        configure_torch_threads(config.device)
        self.config = config
        self.name = name  # the instance's worker id and the rank
        self.runner, self.cache, manager = run_on_compute_thread(
            lambda: self._build(config, rank, address, sizing)
        )
        self.capacity = RankCapacity.of(manager)
        self.signature = manager.layout_signature()  # names this rank's heads
        self._transfer: RankTransfer | None = None
        self._transfer_lock = threading.Lock()

    @staticmethod
    def _build(
        config: WorkerConfig, rank: int, address: str, sizing: CacheSizing
    ) -> tuple[ModelRunner, CacheTensors, KVCacheManager]:
        join_group(address, rank, config.tensor_parallel_size, config.device)
        speculative = config.speculative
        use_mtp = speculative is not None and speculative.uses_model
        model, model_config = load_model(
            config.checkpoint,
            dtype=config.dtype,
            device=config.device,
            tp=TensorParallelShard(rank, config.tensor_parallel_size),
            use_mtp=use_mtp,
        )
        manager, cache, _ = build_cache(config, model_config, sizing)
        mtp = None
        if use_mtp and speculative is not None:
            k = speculative.num_speculative_tokens
            mtp = mtp_drafting(model, k, config.block_size, config.device)
        runner = ModelRunner(
            model,
            cache.views(),
            manager,
            config.block_size,
            sampler=None,  # rank 0 samples
            device=config.device,
            is_hybrid=model_config.cache_spec(config.dtype).is_hybrid,
            mtp=mtp,  # its shard of the MTP layers, run on rank 0's kept chunks
        )
        return runner, cache, manager

    def ready(self) -> RankCapacity:
        """Returns once the rank is built (its shard loaded, its cache allocated)."""
        return self.capacity

    def leave(self) -> None:
        """Leave the instance's group (`RankGroup.close`)."""
        if dist.is_initialized():
            run_on_compute_thread(dist.destroy_process_group)

    def run_step(self, step: StepInput) -> None:
        try:
            run_on_compute_thread(lambda: self.runner.follow(step))
        except BaseException:
            # Rank 0 is inside this step's collectives by now and would wait
            # out GROUP_TIMEOUT_S for this rank; leaving the group at once
            # fails its step now instead.
            logger.exception("tensor-parallel rank failed a step; leaving the instance")
            os._exit(1)

    def run_mtp(self, chunks: list[KeptChunk]) -> None:
        """The MTP drafting of the step `run_step` last ran, on rank 0's kept chunks."""
        try:
            run_on_compute_thread(lambda: self.runner.follow_mtp(chunks))
        except BaseException:
            logger.exception("tensor-parallel rank failed an MTP step; leaving the instance")
            os._exit(1)

    @ray.method(concurrency_group="transfer")
    def publish(self, request_id: str, regions: RequestRegions, lease_s: float) -> TransferHandle:
        """Publish this rank's bytes of a prefilled request (context instance),
        once the step that wrote them has finished on the device. Rank 0
        publishes after that step, so it is on this rank's compute thread
        now or done: the event is read behind it there."""
        run_on_compute_thread(lambda: self.runner.written).wait()
        return self._transfers().publish(request_id, regions, lease_s)

    @ray.method(concurrency_group="transfer")
    def pull(
        self, handles: Sequence[TransferHandle], regions: RequestRegions, timeout_s: float
    ) -> None:
        """Pull this rank's heads of a request from every context rank (generation instance)."""
        self._transfers().pull(handles, regions, timeout_s)

    @ray.method(concurrency_group="transfer")
    def abort(self, request_id: str) -> None:
        if self._transfer is not None:
            self._transfer.abort(request_id)

    @ray.method(concurrency_group="transfer")
    def num_pinned(self) -> int:
        """Requests this rank published and nobody released yet."""
        return self._transfer.num_pinned if self._transfer is not None else 0

    def _transfers(self) -> RankTransfer:
        """This rank's transceiver, started on first use (an aggregated
        instance never moves a cache)."""
        with self._transfer_lock:
            if self._transfer is None:
                self._transfer = RankTransfer(
                    self.config, self.cache.buffers(), self.signature, self.name
                )
            return self._transfer


class RankGroup:
    """Rank 0's side: the other ranks' actors, and each step sent to them."""

    def __init__(self, ranks: list[Any], capacities: list[RankCapacity]) -> None:
        self.ranks = ranks
        self.capacities = capacities  # of ranks 1.., in order

    @classmethod
    def start(cls, config: WorkerConfig, worker_id: str, sizing: CacheSizing) -> RankGroup:
        """Start ranks 1.. (each loads its shard and sizes its cache by `sizing`,
        rank 0's) and join the group with them as rank 0.

        Called on rank 0's compute thread after its own model and cache exist.
        """
        for attempt in range(1, _JOIN_ATTEMPTS + 1):
            address = _free_address(config.transfer_host)
            ranks = _start_ranks(config, worker_id, sizing, address)
            try:
                join_group(address, 0, config.tensor_parallel_size, config.device)
                # Surfaces a rank that failed to load its shard.
                capacities = _wait_for([rank.ready.remote() for rank in ranks])
            except DistNetworkError as exc:
                for rank in ranks:
                    ray.kill(rank)
                # Another process took the free port before the group bound it.
                if attempt == _JOIN_ATTEMPTS or "EADDRINUSE" not in str(exc):
                    raise
                logger.warning("%s: group address %s was taken; retrying", worker_id, address)
                continue
            except BaseException:
                for rank in ranks:
                    ray.kill(rank)
                raise
            logger.info(
                "%s: %d tensor-parallel ranks joined at %s",
                worker_id,
                config.tensor_parallel_size,
                address,
            )
            return cls(ranks, capacities)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def send(self, step: StepInput) -> None:
        for rank in self.ranks:
            rank.run_step.remote(step)

    def send_mtp(self, chunks: list[KeptChunk]) -> None:
        """The step's kept chunks, for the ranks' MTP drafting (sent before rank 0's own)."""
        for rank in self.ranks:
            rank.run_mtp.remote(chunks)

    async def publish(
        self, request_id: str, regions: RequestRegions, lease_s: float
    ) -> list[TransferHandle]:
        """Every other rank's handle of a prefilled request, in rank order."""
        calls = [rank.publish.remote(request_id, regions, lease_s) for rank in self.ranks]
        return list(await asyncio.gather(*calls))

    async def pull(
        self, handles: Sequence[TransferHandle], regions: RequestRegions, timeout_s: float
    ) -> None:
        """Every other rank pulls its heads of a request from every context rank."""
        calls = [rank.pull.remote(list(handles), regions, timeout_s) for rank in self.ranks]
        try:
            await asyncio.gather(*calls)
        except BaseException:
            # Bytes may still land in the blocks until every rank stopped:
            # the caller frees them once this raises.
            self.abort(handles[0].request_id if handles else "")
            await asyncio.gather(*calls, return_exceptions=True)
            raise

    def abort(self, request_id: str) -> None:
        """Stop the other ranks' transfers of a request (either side)."""
        for rank in self.ranks:
            rank.abort.remote(request_id)

    async def num_pinned(self) -> list[int]:
        """Requests each other rank published and nobody released yet, in rank order."""
        return list(await asyncio.gather(*[rank.num_pinned.remote() for rank in self.ranks]))

    def abandon(self) -> None:
        """Rank 0's step failed (a rank died, or a collective failed): the
        other ranks may be inside that step's collectives, and no later step
        can line up with them. The worker process exits, so Ray restarts it
        (the launcher's `max_restarts`) with fresh ranks; its rank actors go
        down with it, their owner. Requests in flight fail as on any dead worker."""
        logger.error("a tensor-parallel step failed; restarting the instance with fresh ranks")
        logging.shutdown()
        os._exit(1)

    def close(self) -> None:
        """Every rank leaves the group together (NCCL tears a communicator down
        collectively; no collective is in flight between steps), then the
        rank actors stop. Runs on the compute thread, where rank 0's
        collectives ran."""
        run_on_compute_thread(self._leave)
        for rank in self.ranks:
            ray.kill(rank)
        self.ranks = []

    def _leave(self) -> None:
        leaving = [rank.leave.remote() for rank in self.ranks]
        if dist.is_initialized():
            dist.destroy_process_group()
        try:
            _wait_for(leaving, LEAVE_TIMEOUT_S)
        except Exception as exc:  # a rank that is gone already is stopped all the same
            logger.warning("a tensor-parallel rank did not leave its group cleanly: %s", exc)
