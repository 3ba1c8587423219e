"""Part 4: a cache transfer between two processes through the Python transceiver.

A holder process (multiprocessing, spawned) allocates a request in a V2 pool
on the device, fills every KV block and Mamba state segment with seeded
random bytes, publishes it and waits for the release. This process pulls it
into its own pool on the device and checks every byte. The pull's GB/s is
set next to a raw device -> host -> device copy of the same size in this
process (the least any transfer through host memory costs) and to the same
bytes sent raw over loopback TCP between the two processes, host memory to
host memory, no framing (the least the Python transceiver's socket costs:
`benchmarks.transfer.raw`'s raw TCP limit).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import secrets
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from benchmarks.transfer.raw import connect_raw_tcp, fetch_raw_tcp, serve_raw_tcp
from kvcache.factory import create_manager
from kvcache.layout import Region
from kvcache.manager import KVCacheManager
from kvcache.spec import CacheSpec
from kvcache.tensors import CacheTensors, allocate_cache_tensors
from transfer.factory import create_transceiver
from transfer.handle import TransferHandle

BLOCK_SIZE = 16
# 512 KiB of bf16 K/V per block (8 layers) plus two Mamba layers' state.
SPEC = CacheSpec(
    num_kv_heads=8,
    head_dim=128,
    attention_layers=tuple(range(1, 17, 2)),
    dtype="bfloat16",
    mamba_layers=(0, 2),
    conv_state_shape=(1024, 3),
    ssm_state_shape=(16, 64, 64),
)
SEED = 11
_TIMEOUT_S = 120.0
# Request id -> blocks (0: the size asked for). "warm" opens the connection.
_REQUESTS = {"warm": 1, "r": 0}


class _Pool:
    """One side's manager and pool tensors on the device."""

    def __init__(self, device: str, num_blocks: int) -> None:
        self.manager: KVCacheManager = create_manager("v2", SPEC, num_blocks, BLOCK_SIZE, 2)
        self.tensors: CacheTensors = allocate_cache_tensors(self.manager, device)

    def segments(self, request_id: str) -> list[tuple[object, Region]]:
        """The request's KV pieces and Mamba segments in a fixed (logical) order."""
        regions = self.manager.regions(request_id).contiguous_segments()
        return sorted(regions.items(), key=lambda item: repr(item[0]))

    def expected(self, request_id: str) -> list[torch.Tensor]:
        """The seeded bytes of every segment (the same on both sides)."""
        gen = torch.Generator().manual_seed(SEED + len(request_id))
        return [
            torch.randint(0, 256, (region.length,), generator=gen, dtype=torch.uint8)
            for _, region in self.segments(request_id)
        ]


def _hold(pipe: Connection, device: str, num_blocks: int, secret: bytes) -> None:
    asyncio.run(_publish_and_wait(pipe, device, num_blocks, secret))


async def _publish_and_wait(pipe: Connection, device: str, num_blocks: int, secret: bytes) -> None:
    pool = _Pool(device, num_blocks + 2)
    xcvr = create_transceiver("python", pool.tensors.buffers(), secret=secret)
    await xcvr.start()
    released: dict[str, asyncio.Event] = {rid: asyncio.Event() for rid in _REQUESTS}
    # The raw TCP limit's source, served until the holder ends.
    pool_bytes = sum(t.numel() * t.element_size() for t in pool.tensors.buffers().values())
    listener = serve_raw_tcp(torch.ones(pool_bytes, dtype=torch.uint8).numpy().data.cast("B"))
    try:
        handles = []
        for rid, blocks in _REQUESTS.items():
            assert pool.manager.allocate_slots(rid, (blocks or num_blocks) * BLOCK_SIZE)
            for (_, region), data in zip(pool.segments(rid), pool.expected(rid), strict=True):
                pool.tensors.region_tensor(region).copy_(data)
            handle = xcvr.publish(
                rid,
                pool.manager.regions(rid),
                pool.manager.layout_signature(),
                _TIMEOUT_S,
                lambda done: released[done].set(),
            )
            handles.append(handle.to_bytes())
        pipe.send((handles, listener.getsockname()[:2]))
        for event in released.values():
            await asyncio.wait_for(event.wait(), _TIMEOUT_S)
        pipe.send("released")
    finally:
        listener.close()
        await xcvr.close()


async def _pull_all(
    handles: list[TransferHandle],
    raw_endpoint: tuple[str, int],
    device: str,
    num_blocks: int,
    secret: bytes,
) -> dict[str, Any]:
    """Pull the one-block request (it opens the connection), then the timed
    one, after measuring its bytes over raw TCP."""
    pool = _Pool(device, num_blocks + 2)
    xcvr = create_transceiver("python", pool.tensors.buffers(), secret=secret)
    await xcvr.start()
    try:
        for handle in handles:
            rid = handle.request_id
            blocks = _REQUESTS[rid] or num_blocks
            assert pool.manager.allocate_for_transfer(rid, blocks * BLOCK_SIZE)
            if rid == "r":
                num_bytes = sum(region.length for _, region in pool.segments(rid))
                tcp = _raw_tcp_gbps(raw_endpoint, num_bytes)
            start = time.perf_counter()
            await xcvr.pull(
                handle, pool.manager.regions(rid), pool.manager.layout_signature(), _TIMEOUT_S
            )
            seconds = time.perf_counter() - start
            pool.manager.finish_transfer(rid)
        exact = all(
            torch.equal(pool.tensors.region_tensor(region).cpu(), data)
            for rid in _REQUESTS
            for (_, region), data in zip(pool.segments(rid), pool.expected(rid), strict=True)
        )
    finally:
        await xcvr.close()
    return {"bytes": num_bytes, "seconds": seconds, "exact": exact, "raw_tcp_gb_s": tcp}


def _raw_copy_gbps(device: str, num_bytes: int) -> float:
    """GB/s of one device -> host -> device copy of `num_bytes` (best of 3)."""
    src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=torch.device(device).type == "cuda")
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        host.copy_(src)
        dst.copy_(host)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    assert torch.equal(src, dst)
    return num_bytes / best / 1e9


def _raw_tcp_gbps(endpoint: tuple[str, int], num_bytes: int) -> float:
    """GB/s of `num_bytes` sent raw from the holder over loopback TCP (best of 3)."""
    view = torch.empty(num_bytes, dtype=torch.uint8).numpy().data.cast("B")
    with connect_raw_tcp(endpoint) as sock:
        best = min(fetch_raw_tcp(sock, view)[0] for _ in range(3))
    return num_bytes / best / 1e9


def check_transfer(device: str, num_blocks: int) -> dict[str, Any]:
    secret = secrets.token_bytes(16)
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    holder = ctx.Process(target=_hold, args=(theirs, device, num_blocks, secret), daemon=True)
    holder.start()
    try:
        if not ours.poll(_TIMEOUT_S):
            raise TimeoutError(f"the holder process sent no handle within {_TIMEOUT_S:.0f} s")
        sent, endpoint = ours.recv()
        handles = [TransferHandle.from_bytes(data) for data in sent]
        result = asyncio.run(_pull_all(handles, endpoint, device, num_blocks, secret))
        released = ours.poll(_TIMEOUT_S) and ours.recv() == "released"
    finally:
        holder.join(timeout=30)
        if holder.is_alive():
            holder.kill()
            holder.join()
    gbps = result["bytes"] / result["seconds"] / 1e9
    raw = _raw_copy_gbps(device, result["bytes"])
    return {
        "mib": result["bytes"] / 2**20,
        "exact_bytes": result["exact"],
        "holder_released": released,
        "transfer_gb_s": gbps,
        "raw_d2h2d_gb_s": raw,
        "ratio_to_raw": gbps / raw,
        "raw_tcp_gb_s": result["raw_tcp_gb_s"],
        "ratio_to_tcp": gbps / result["raw_tcp_gb_s"],
        "ok": result["exact"] and released,
    }
