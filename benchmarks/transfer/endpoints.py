"""A cache endpoint for exercising transceivers across processes (benchmark, tests).

One `CacheEndpoint` is what a worker owns for transfers: a manager, its pool
tensors and a started transceiver. `EndpointHost` bundles endpoints by name so
one Ray actor can host several (a V1 and a V2 pool on each backend) and be
driven through plain, picklable arguments: ids, sizes, handle bytes and
SHA-256 digests instead of cache contents.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvcache.factory import create_manager
from kvcache.layout import Region
from kvcache.spec import CacheSpec
from kvcache.tensors import allocate_cache_tensors
from runtime.startup_heap import freeze_startup_heap
from transfer.base import Transceiver
from transfer.errors import TransferError
from transfer.factory import create_transceiver
from transfer.handle import TransferHandle


@dataclass(frozen=True)
class EndpointSpec:
    """What to build: `kind` ("python" | "nixl"), `manager` ("v1" | "v2"), pool sizes,
    and the Python transceiver's `wire` ("tcp" | "ucx")."""

    kind: str
    manager: str
    spec: CacheSpec
    num_blocks: int
    block_size: int
    num_slots: int = 4
    secret: bytes = b"bench"
    wire: str = "tcp"


class CacheEndpoint:
    """A manager + pool tensors + transceiver, driven by request id."""

    def __init__(self, cfg: EndpointSpec) -> None:
        self.manager = create_manager(
            cfg.manager, cfg.spec, cfg.num_blocks, cfg.block_size, cfg.num_slots
        )
        self.tensors = allocate_cache_tensors(self.manager)
        self.xcvr = _make_transceiver(cfg, self.tensors.buffers())
        self.released: list[str] = []

    def fill(self, request_id: str, num_tokens: int, seed: int = 0) -> dict[str, str]:
        """Allocate `num_tokens` tokens and write random bytes; returns segment digests."""
        if not self.manager.allocate_slots(request_id, num_tokens):
            raise RuntimeError(f"pool too small for {num_tokens} tokens")
        generator = torch.Generator().manual_seed(seed)
        for region in self.manager.regions(request_id).descriptors:
            view = self.tensors.region_tensor(region)
            view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, generator=generator))
        return self.digests(request_id)

    def digests(self, request_id: str) -> dict[str, str]:
        """SHA-256 of every KV piece and Mamba segment, keyed by
        "kv/<layer>/<block>/<head>" and "mamba/<layer>/<kind>"."""
        regions = self.manager.regions(request_id)
        return {
            "/".join(["kv" if len(key) == 3 else "mamba", *map(str, key)]): self._digest(r)
            for key, r in regions.contiguous_segments().items()
        }

    def publish(self, request_id: str, lease_s: float, alias: str | None = None) -> bytes:
        """Publish `request_id`'s cache; under `alias`, publish it again without
        freeing it on release (for repeated pulls of one filled request)."""
        on_release = self._on_release if alias is None else self.released.append
        handle = self.xcvr.publish(
            alias or request_id,
            self.manager.regions(request_id),
            self.manager.layout_signature(),
            lease_s,
            on_release,
        )
        return handle.to_bytes()

    async def pull(self, handle_bytes: bytes, num_tokens: int, timeout_s: float) -> dict[str, Any]:
        """Allocate, pull, finish; frees on error. Returns {"ok", "seconds",
        "cpu_seconds" (this process, all threads, during the pull), "error", "message"}."""
        return await self.pull_ranks([handle_bytes], num_tokens, timeout_s)

    async def pull_ranks(
        self, handles_bytes: list[bytes], num_tokens: int, timeout_s: float
    ) -> dict[str, Any]:
        """`pull` of one request held by several tensor-parallel ranks, one
        handle each (rank 0's last): this endpoint's heads from every one.
        "seconds" and "cpu_seconds" are the transceiver's alone; "started" and
        "ended" (perf_counter, one clock for every process on this machine)
        bound it, for a caller timing puller ranks in several processes."""
        handles = [TransferHandle.from_bytes(h) for h in handles_bytes]
        rid = handles[-1].request_id
        if not self.manager.allocate_for_transfer(rid, num_tokens):
            raise RuntimeError(f"pool too small to receive {num_tokens} tokens")
        regions, signature = self.manager.regions(rid), self.manager.layout_signature()
        start, cpu = time.perf_counter(), time.process_time()
        try:
            await self.xcvr.pull_ranks(handles, regions, signature, timeout_s)
        except TransferError as exc:
            self.manager.free(rid)
            return _outcome(start, time.perf_counter(), time.process_time() - cpu, exc)
        end, used = time.perf_counter(), time.process_time() - cpu
        self.manager.finish_transfer(rid)
        return _outcome(start, end, used)

    def state(self) -> dict[str, Any]:
        """Free blocks, pinned requests and releases so far; raises if the pool is inconsistent."""
        self.manager.check_integrity()
        return {
            "free_blocks": self.manager.num_free_blocks,
            "pinned": self.xcvr.num_pinned,
            "released": list(self.released),
        }

    def _on_release(self, request_id: str) -> None:
        self.released.append(request_id)
        self.manager.free(request_id)

    def _digest(self, region: Region) -> str:
        return hashlib.sha256(self.tensors.read_region(region)).hexdigest()


class EndpointHost:
    """Several named endpoints in one process (the body of a Ray actor)."""

    def __init__(self, specs: dict[str, EndpointSpec]) -> None:
        torch.set_num_threads(1)
        self.endpoints = {name: CacheEndpoint(cfg) for name, cfg in specs.items()}

    async def start(self) -> None:
        for endpoint in self.endpoints.values():
            await endpoint.xcvr.start()
        freeze_startup_heap()  # as a worker does once its model and caches are up

    async def close(self) -> None:
        for endpoint in self.endpoints.values():
            await endpoint.xcvr.close()

    def fill(self, name: str, request_id: str, num_tokens: int, seed: int = 0) -> dict[str, str]:
        return self.endpoints[name].fill(request_id, num_tokens, seed)

    def digests(self, name: str, request_id: str) -> dict[str, str]:
        return self.endpoints[name].digests(request_id)

    def publish(
        self, name: str, request_id: str, lease_s: float, alias: str | None = None
    ) -> bytes:
        return self.endpoints[name].publish(request_id, lease_s, alias)

    async def pull(
        self, name: str, handle_bytes: bytes, num_tokens: int, timeout_s: float
    ) -> dict[str, Any]:
        return await self.endpoints[name].pull(handle_bytes, num_tokens, timeout_s)

    async def pull_ranks(
        self, name: str, handles_bytes: list[bytes], num_tokens: int, timeout_s: float
    ) -> dict[str, Any]:
        return await self.endpoints[name].pull_ranks(handles_bytes, num_tokens, timeout_s)

    def free(self, name: str, request_id: str) -> None:
        self.endpoints[name].manager.free(request_id)

    def abort(self, name: str, request_id: str) -> None:
        """Abort on the endpoint's transceiver (a holder's `on_release` frees the blocks)."""
        self.endpoints[name].xcvr.abort(request_id)

    def state(self, name: str) -> dict[str, Any]:
        return self.endpoints[name].state()

    def cpu_seconds(self) -> float:
        """CPU time this process has used so far, all threads (for per-transfer deltas)."""
        return time.process_time()

    def pid(self) -> int:
        import os

        return os.getpid()

    async def idle_cpu(self, seconds: float) -> float:
        """Fraction of one core this process used while idle for `seconds`."""
        import asyncio

        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.sleep(seconds)
        return (time.process_time() - cpu) / (time.perf_counter() - wall)


def _outcome(
    started: float, ended: float, cpu_seconds: float, error: TransferError | None = None
) -> dict[str, Any]:
    """A pull's result as the benchmark and tests read it."""
    return {
        "ok": error is None,
        "seconds": ended - started,
        "cpu_seconds": cpu_seconds,
        "started": started,
        "ended": ended,
        "error": None if error is None else type(error).__name__,
        "message": "" if error is None else str(error),
    }


def _make_transceiver(cfg: EndpointSpec, buffers: dict[str, torch.Tensor]) -> Transceiver:
    return create_transceiver(cfg.kind, buffers, secret=cfg.secret, wire=cfg.wire)
