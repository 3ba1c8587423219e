"""The NIXL transceiver with two agents in one process (UCX loopback)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import torch

from kvcache.factory import create_manager
from kvcache.manager import KVCacheManager
from kvcache.spec import CacheSpec
from kvcache.tensors import CacheTensors, allocate_cache_tensors
from transfer.base import TransferHandle
from transfer.errors import LayoutMismatch, UnknownRequest
from transfer.nixl_transceiver import NixlTransceiver, nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="nixl is not importable")

HYBRID = CacheSpec(
    num_kv_heads=2,
    head_dim=8,
    attention_layers=(1, 3),
    mamba_layers=(0, 2),
    conv_state_shape=(12, 3),
    ssm_state_shape=(2, 4, 8),
)
BLOCK_SIZE = 4


class Worker:
    def __init__(self, manager: str, block_size: int = BLOCK_SIZE) -> None:
        self.manager: KVCacheManager = create_manager(manager, HYBRID, 16, block_size, 4)
        self.tensors: CacheTensors = allocate_cache_tensors(self.manager)
        self.xcvr = NixlTransceiver(self.tensors.buffers())
        self.released: list[str] = []

    def fill(self, request_id: str, num_tokens: int) -> dict[object, bytes]:
        assert self.manager.allocate_slots(request_id, num_tokens)
        regions = self.manager.regions(request_id)
        contents: dict[object, bytes] = {}
        for key, region in [*regions.kv_segments.items(), *regions.mamba_segments.items()]:
            data = torch.randint(0, 256, (region.length,), dtype=torch.uint8).numpy().tobytes()
            self.tensors.write_region(region, data)
            contents[key] = data
        return contents

    def segments(self, request_id: str) -> dict[object, bytes]:
        regions = self.manager.regions(request_id)
        return {
            key: self.tensors.read_region(region)
            for key, region in [*regions.kv_segments.items(), *regions.mamba_segments.items()]
        }

    def publish(self, request_id: str, lease_s: float = 30.0) -> TransferHandle:
        def on_release(rid: str) -> None:
            self.released.append(rid)
            self.manager.free(rid)

        regions = self.manager.regions(request_id)
        signature = self.manager.layout_signature()
        return self.xcvr.publish(request_id, regions, signature, lease_s, on_release)

    async def pull(self, handle: TransferHandle, num_tokens: int) -> None:
        rid = handle.request_id
        assert self.manager.allocate_for_transfer(rid, num_tokens)
        try:
            regions = self.manager.regions(rid)
            await self.xcvr.pull(handle, regions, self.manager.layout_signature(), 10)
        except BaseException:
            self.manager.free(rid)
            raise
        self.manager.finish_transfer(rid)


async def wait_for(condition: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:  # type: ignore[operator]
        await asyncio.sleep(0.01)


@pytest.fixture
async def workers() -> AsyncIterator[dict[str, Worker]]:
    pool = {"v1": Worker("v1"), "v2": Worker("v2"), "v2b": Worker("v2"), "v1b": Worker("v1")}
    for worker in pool.values():
        await worker.xcvr.start()
    yield pool
    for worker in pool.values():
        await worker.xcvr.close()


@pytest.mark.parametrize("src_name,dst_name", [("v1", "v1b"), ("v2", "v2b")])
async def test_moves_hybrid_cache_exactly_and_notification_releases_holder(
    workers: dict[str, Worker], src_name: str, dst_name: str
) -> None:
    src, dst = workers[src_name], workers[dst_name]
    free_before = src.manager.num_free_blocks
    prepared: list[int] = []
    for i, num_tokens in enumerate([3 * BLOCK_SIZE - 1, BLOCK_SIZE]):
        rid = f"r{i}"
        sent = src.fill(rid, num_tokens)
        await dst.pull(TransferHandle.from_bytes(src.publish(rid).to_bytes()), num_tokens)
        assert dst.segments(rid) == sent
        await wait_for(lambda rid=rid: rid in src.released)
        assert src.released[-1] == rid
        assert dst.xcvr._local is not None
        prepared.append(
            len(dst.xcvr._local._handles) + len(dst.xcvr._remote[src.xcvr.name]._handles)
        )
    assert src.manager.num_free_blocks == free_before
    # descriptor lists are prepared per pool, not per request
    assert prepared[0] > 0 and prepared[1] == prepared[0]
    src.manager.check_integrity()
    dst.manager.check_integrity()


@pytest.mark.parametrize("field", ["manager", "block_size"])
async def test_layout_mismatch_is_refused_before_any_byte_moves(
    workers: dict[str, Worker], field: str
) -> None:
    src = workers["v2"]
    dst = workers["v1"] if field == "manager" else Worker("v2", block_size=2 * BLOCK_SIZE)
    if field != "manager":
        await dst.xcvr.start()
    try:
        src.fill("r1", BLOCK_SIZE)
        with pytest.raises(LayoutMismatch, match=field):
            await dst.pull(src.publish("r1"), BLOCK_SIZE)
        assert all(torch.count_nonzero(t) == 0 for t in dst.tensors.buffers().values())
        assert src.xcvr.num_pinned == 1 and src.released == []
    finally:
        if field != "manager":
            await dst.xcvr.close()


async def test_lease_expiry_frees_the_holder(workers: dict[str, Worker]) -> None:
    src = workers["v2"]
    free_before = src.manager.num_free_blocks
    src.fill("r1", 2 * BLOCK_SIZE)
    src.publish("r1", lease_s=0.1)
    await asyncio.sleep(0.3)
    assert src.released == ["r1"]
    assert src.manager.num_free_blocks == free_before
    src.manager.check_integrity()
    src.fill("r2", BLOCK_SIZE)
    with pytest.raises(ValueError, match="lease_s"):
        src.publish("r2", lease_s=0)


async def test_pull_after_lease_expiry_reads_nothing(workers: dict[str, Worker]) -> None:
    src, dst = workers["v2"], workers["v2b"]
    src.fill("r1", BLOCK_SIZE)
    handle = src.publish("r1", lease_s=0.05)
    await asyncio.sleep(0.1)
    with pytest.raises(UnknownRequest, match="lease_s"):
        await dst.pull(handle, BLOCK_SIZE)
    assert all(torch.count_nonzero(t) == 0 for t in dst.tensors.buffers().values())
    dst.manager.check_integrity()


async def test_abort_on_holder_releases_once(workers: dict[str, Worker]) -> None:
    src = workers["v2"]
    src.fill("r1", BLOCK_SIZE)
    src.publish("r1")
    src.xcvr.abort("r1")
    src.xcvr.abort("r1")
    assert not src.xcvr.release("r1")
    assert src.released == ["r1"]
    src.manager.check_integrity()


async def test_idle_agents_do_not_spin_a_core(workers: dict[str, Worker]) -> None:
    cpu_before, wall_before = time.process_time(), time.monotonic()
    await asyncio.sleep(1.0)
    cpu = time.process_time() - cpu_before
    # four agents with UCX progress threads; a zero poll delay would cost ~1 s each
    assert cpu < 0.5 * (time.monotonic() - wall_before)
