"""The frozen configuration every worker actor is constructed from.

`WorkerConfig` is built once by the launcher from the (pydantic) cluster YAML
after every `auto` value has been resolved: the manager is `"v1"` or `"v2"`,
the transceiver `"python"` or `"nixl"`. Workers never patch it afterwards.
The one exception is `transfer_wire`: whether `ucxx` imports is a property of
the worker's node, so "auto" is resolved on the worker when its transceiver
is built (`transfer.python.wires.resolve_wire`, logged there).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from engine.speculation.config import SpeculativeConfig
from kvcache.dtypes import DTYPE_NAMES
from kvcache.snapshots import SnapshotPolicy

if TYPE_CHECKING:
    import torch

    from engine.checkpoint_copy import CheckpointSource
    from transfer.base import Transceiver

MANAGERS = ("v1", "v2")
TRANSCEIVERS = ("python", "nixl")
TRANSFER_WIRES = ("tcp", "ucx", "auto")


class WorkerConfigError(ValueError):
    """A `WorkerConfig` field holds a value no worker can run with."""


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a context, generation or aggregated worker needs to start.

    checkpoint: folder with config.json, *.safetensors and tokenizer files,
        as the serving node names it.
    checkpoint_source: for an instance off the serving node, where its
        worker finds or copies the checkpoint on the node it starts on (its
        first start and any restart by Ray, on whatever node): see
        `on_this_node`. None: `checkpoint` is the folder to load.
    dtype: weights and KV cache dtype; None takes the checkpoint's own.
    device: "cpu" or "cuda" (the actor's visible device).
    manager: resolved KV cache manager, "v1" or "v2".
    transceiver: resolved cache transceiver, "python" or "nixl".
    block_size: tokens per KV block.
    max_tokens: KV capacity in tokens (rounded down to whole blocks). When
        None, `kv_cache_memory_bytes` sizes the cache instead.
    kv_cache_memory_bytes: memory budget for KV blocks and Mamba slots; used
        only when `max_tokens` is None.
    memory_fraction: with neither of the two above, on CUDA: the fraction of
        this instance's share of its GPU (`gpu_share` times its memory) that
        weights, one step's activations and the cache may take together,
        measured by the worker once its weights are loaded.
    gpu_share: the instance's `num_gpus` (0.5 when two share a GPU).
    max_num_tokens: per-step token budget (decode tokens + prefill chunks).
    max_batch_size: most sequences in one step; also the number of Mamba
        state slots a hybrid model gets.
    max_num_waiting: most requests queued for prefill on this worker; more
        are refused at once (the router then tries another worker).
    enable_block_reuse: prefix reuse (V2 only; for a hybrid model only with
        a `snapshots` policy that takes Mamba state snapshots).
    snapshots: where a hybrid model's Mamba state is snapshotted for reuse,
        and how many snapshots its cache keeps (`kvcache.snapshots`).
    lease_s: how long a context worker keeps a finished prompt's blocks
        pinned waiting for the generation side to pull them.
    transfer_timeout_s: how long a generation worker waits for one pull.
    cluster_secret: shared token that transceivers use to authenticate peers.
    transfer_host: address the transceiver listens on and advertises;
        empty: the address of the Ray node the worker runs on (wherever Ray
        starts or restarts it).
    tensor_parallel_size: ranks of the instance; this worker is rank 0 and
        starts the others (`engine.tensor_parallel`).
    transfer_wire: what the Python transceiver listens on: "tcp", "ucx" or
        "auto" (UCX when `ucxx` imports on this node). Pulls follow the wire
        the holder's handle names.
    cpu_affinity: CPU ids the worker process is pinned to (every thread);
        empty: wherever the OS runs it.
    speculative: speculative decoding (`engine.speculation`); None: off.
    """

    checkpoint: str
    checkpoint_source: CheckpointSource | None = None
    dtype: str | None = None
    device: str = "cpu"
    manager: str = "v1"
    transceiver: str = "python"
    block_size: int = 16
    max_tokens: int | None = 8192
    kv_cache_memory_bytes: int | None = None
    memory_fraction: float | None = None
    gpu_share: float = 1.0
    max_num_tokens: int = 512
    max_batch_size: int = 64
    max_num_waiting: int = 1024
    enable_block_reuse: bool = False
    lease_s: float = 30.0
    transfer_timeout_s: float = 30.0
    cluster_secret: str = ""
    transfer_host: str = "127.0.0.1"
    transfer_wire: str = "tcp"
    tensor_parallel_size: int = 1
    cpu_affinity: tuple[int, ...] = ()
    snapshots: SnapshotPolicy | None = None
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.manager not in MANAGERS:
            raise WorkerConfigError(
                f"manager must be one of {MANAGERS} (resolve 'auto' before building "
                f"workers), got {self.manager!r}"
            )
        if self.transceiver not in TRANSCEIVERS:
            raise WorkerConfigError(
                f"transceiver must be one of {TRANSCEIVERS} (resolve 'auto' before "
                f"building workers), got {self.transceiver!r}"
            )
        if self.transfer_wire not in TRANSFER_WIRES:
            raise WorkerConfigError(
                f"transfer_wire must be one of {TRANSFER_WIRES}, got {self.transfer_wire!r}"
            )
        if self.dtype is not None and self.dtype not in DTYPE_NAMES:
            raise WorkerConfigError(
                f"dtype must be one of {DTYPE_NAMES} or None, got {self.dtype!r}"
            )
        sized_by_gpu = self.memory_fraction is not None and self.device.startswith("cuda")
        if self.max_tokens is None and self.kv_cache_memory_bytes is None and not sized_by_gpu:
            raise WorkerConfigError(
                "set max_tokens or kv_cache_memory_bytes to size the KV cache "
                "(or memory_fraction on a CUDA device)"
            )
        _require_positive("block_size", self.block_size)
        _require_positive("tensor_parallel_size", self.tensor_parallel_size)
        _require_positive("max_num_tokens", self.max_num_tokens)
        _require_positive("max_batch_size", self.max_batch_size)
        _require_positive("max_num_waiting", self.max_num_waiting)
        _require_positive("lease_s", self.lease_s)
        _require_positive("transfer_timeout_s", self.transfer_timeout_s)
        if self.max_tokens is not None and self.max_tokens < self.block_size:
            raise WorkerConfigError(
                f"max_tokens ({self.max_tokens}) must hold at least one block of "
                f"{self.block_size} tokens"
            )

    def on_this_node(self, worker_id: str) -> WorkerConfig:
        """These settings as the node this process runs on resolves them; run
        where the worker starts (its first start, or a restart by Ray on
        another node), before anything reads them.

        `checkpoint` becomes the folder this node loads, found or copied
        (`engine.checkpoint_copy.node_checkpoint`) when `checkpoint_source`
        is set; an empty `transfer_host` becomes this node's address.
        """
        checkpoint, host = self.checkpoint, self.transfer_host
        if self.checkpoint_source is not None:
            from engine.checkpoint_copy import node_checkpoint

            checkpoint = node_checkpoint(self.checkpoint_source, worker_id)
        if not host:
            import ray

            host = ray.util.get_node_ip_address()
        return replace(self, checkpoint=checkpoint, checkpoint_source=None, transfer_host=host)

    def create_transceiver(self, buffers: Mapping[str, torch.Tensor], name: str) -> Transceiver:
        """The transceiver these settings name, over one rank's pool `buffers`
        (not started); `name` is the worker (or rank) it belongs to."""
        from transfer.factory import create_transceiver

        return create_transceiver(
            self.transceiver,
            buffers,
            secret=self.cluster_secret.encode(),
            name=name,
            host=self.transfer_host,
            wire=self.transfer_wire,
        )


def _require_positive(name: str, value: float) -> None:
    if value <= 0:
        raise WorkerConfigError(f"{name} must be positive, got {value}")
