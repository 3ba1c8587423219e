"""Part 4, second row: a tensor-parallel (head-sliced) pull between two processes.

A holder process with the whole model's KV heads (context TP 1) publishes
a request; this process, rank 0 of a generation instance at TP 2, pulls
only its half of the heads through the Python transceiver. Both pools are
V1, so the holder's half of each block is a strided run (its heads are a
part of every (layer, block) tile), which the transceiver gathers and
scatters through host staging chunks (`transfer.python.staging`): on CUDA
because device buffers have no host view, under `--device cpu` because the
transceivers are built with `stage_through_host`. Every key and value the
rank holds must equal its heads of the holder's, position for position.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import secrets
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvcache.dtypes import torch_dtype
from kvcache.factory import create_manager
from kvcache.spec import CacheSpec
from kvcache.tensors import allocate_cache_tensors
from transfer.base import Transceiver
from transfer.factory import create_transceiver
from transfer.handle import TransferHandle
from transfer.python.transceiver import PythonTransceiver

BLOCK_SIZE = 16
# 8 KV heads of 128 bf16 over 4 layers: 256 KiB of K/V per block, a rank half of it.
WHOLE = CacheSpec(num_kv_heads=8, head_dim=128, attention_layers=tuple(range(4)), dtype="bfloat16")
GEN_TP = 2
SEED = 23
_TIMEOUT_S = 120.0


class _Pool:
    """One side's V1 manager and pool tensors, for `spec`'s heads."""

    def __init__(self, spec: CacheSpec, device: str, num_blocks: int) -> None:
        self.manager = create_manager("v1", spec, num_blocks, BLOCK_SIZE, 1)
        self.tensors = allocate_cache_tensors(self.manager, device)

    def transceiver(self, secret: bytes, stage: bool) -> Transceiver:
        buffers = self.tensors.buffers()
        if stage:  # host pools: through the staging chunks, as device pools go
            return PythonTransceiver(buffers, secret, stage_through_host=True)
        return create_transceiver("python", buffers, secret=secret)

    def blocks(self, request_id: str) -> torch.Tensor:
        table = self.manager.block_table(request_id)
        return torch.tensor(list(table), dtype=torch.int64)


def whole_kv(num_blocks: int) -> torch.Tensor:
    """`[layers, blocks, 2 (K, V), block_size, heads, head_dim]`: the request's
    K/V with every head, by logical block; the same in both processes."""
    gen = torch.Generator().manual_seed(SEED)
    shape = (WHOLE.num_attention_layers, num_blocks, 2, BLOCK_SIZE, WHOLE.num_kv_heads)
    return torch.randn(*shape, WHOLE.head_dim, generator=gen).to(torch_dtype(WHOLE.dtype))


def _hold(pipe: Connection, device: str, num_blocks: int, secret: bytes, stage: bool) -> None:
    asyncio.run(_publish_and_wait(pipe, device, num_blocks, secret, stage))


async def _publish_and_wait(
    pipe: Connection, device: str, num_blocks: int, secret: bytes, stage: bool
) -> None:
    pool = _Pool(WHOLE, device, num_blocks + 2)
    xcvr = pool.transceiver(secret, stage)
    await xcvr.start()
    released = asyncio.Event()
    try:
        assert pool.manager.allocate_slots("r", num_blocks * BLOCK_SIZE)
        blocks, data = pool.blocks("r").to(device), whole_kv(num_blocks).to(device)
        for k, layer in enumerate(pool.tensors.views().attention):
            layer.key_cache[blocks] = data[k, :, 0]
            layer.value_cache[blocks] = data[k, :, 1]
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()  # the writes land before the blocks are offered
        handle = xcvr.publish(
            "r",
            pool.manager.regions("r"),
            pool.manager.layout_signature(),
            _TIMEOUT_S,
            lambda _: released.set(),
        )
        pipe.send(handle.to_bytes())
        await asyncio.wait_for(released.wait(), _TIMEOUT_S)
        pipe.send("released")
    finally:
        await xcvr.close()


async def _pull_rank(
    rank: int, handle: TransferHandle, device: str, num_blocks: int, secret: bytes, stage: bool
) -> tuple[bool, int, float]:
    """Rank `rank` of the generation instance pulls its heads: (exact, bytes, seconds)."""
    spec = WHOLE.for_rank(rank, GEN_TP)
    pool = _Pool(spec, device, num_blocks + 2)
    xcvr = pool.transceiver(secret, stage)
    await xcvr.start()
    try:
        assert pool.manager.allocate_for_transfer("r", num_blocks * BLOCK_SIZE)
        start = time.perf_counter()
        await xcvr.pull(
            handle, pool.manager.regions("r"), pool.manager.layout_signature(), _TIMEOUT_S
        )
        seconds = time.perf_counter() - start
        pool.manager.finish_transfer("r")
        first, last = spec.heads.kv_heads
        want = whole_kv(num_blocks)[..., first:last, :]
        blocks = pool.blocks("r").to(device)
        exact = all(
            torch.equal(layer.key_cache[blocks].cpu(), want[k, :, 0])
            and torch.equal(layer.value_cache[blocks].cpu(), want[k, :, 1])
            for k, layer in enumerate(pool.tensors.views().attention)
        )
    finally:
        await xcvr.close()
    return exact, want.numel() * want.element_size(), seconds


async def _pull_every_rank(
    handle: TransferHandle, device: str, num_blocks: int, secret: bytes, stage: bool
) -> list[tuple[bool, int, float]]:
    """Each rank in turn (the holder is released once all of them pulled)."""
    return [
        await _pull_rank(rank, handle, device, num_blocks, secret, stage) for rank in range(GEN_TP)
    ]


def check_sliced_transfer(device: str, num_blocks: int) -> dict[str, Any]:
    """The head-sliced pull's row: exact bytes, the holder released, GB/s."""
    stage = torch.device(device).type != "cuda"
    secret = secrets.token_bytes(16)
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    holder = ctx.Process(
        target=_hold, args=(theirs, device, num_blocks, secret, stage), daemon=True
    )
    holder.start()
    try:
        if not ours.poll(_TIMEOUT_S):
            raise TimeoutError(f"the holder process sent no handle within {_TIMEOUT_S:.0f} s")
        handle = TransferHandle.from_bytes(ours.recv())
        ranks = asyncio.run(_pull_every_rank(handle, device, num_blocks, secret, stage))
        released = ours.poll(_TIMEOUT_S) and ours.recv() == "released"
    finally:
        holder.join(timeout=30)
        if holder.is_alive():
            holder.kill()
            holder.join()
    exact = all(rank_exact for rank_exact, _, _ in ranks)
    num_bytes, seconds = sum(r[1] for r in ranks), sum(r[2] for r in ranks)
    return {
        "check": f"TP 1 -> {GEN_TP} head-sliced pulls, V1, staged through host memory",
        "mib": num_bytes / 2**20,
        "exact_bytes": exact,
        "holder_released": released,
        # Each rank's pull opens its own connection: a check, not a speed.
        "gb_s_with_connect": num_bytes / seconds / 1e9,
        "ok": exact and released,
    }
