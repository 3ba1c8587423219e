"""The Python transceiver within one event loop: bytes, bridging, leases, errors."""

from __future__ import annotations

import asyncio
import socket
import time
import tracemalloc
from collections.abc import AsyncIterator

import pytest

from kvcache.factory import create_manager
from kvcache.spec import CacheSpec
from kvcache.tensors import allocate_cache_tensors
from tests.head_shards import HYBRID_WHOLE
from tests.transfer_harness import (
    BLOCK_SIZE,
    HYBRID,
    Endpoint,
    check_head_slice_exchange,
    check_offered_blocks_then_the_rest,
    check_skewed_wall_clocks,
)
from transfer.errors import (
    LayoutMismatch,
    PeerGone,
    TransferAborted,
    TransferTimeout,
    UnknownRequest,
    WireError,
)
from transfer.factory import create_transceiver
from transfer.handle import TransferHandle
from transfer.python.transceiver import PythonTransceiver

SECRET = b"cluster-secret"


def python_endpoint(
    manager: str,
    spec: CacheSpec = HYBRID,
    secret: bytes = SECRET,
    device: str = "cpu",
    stage: bool = False,
    num_blocks: int = 16,
) -> Endpoint:
    """A pool with a Python transceiver (not started)."""
    return Endpoint(
        manager,
        lambda buffers: PythonTransceiver(buffers, secret, stage_through_host=stage),
        spec,
        num_blocks=num_blocks,
        device=device,
    )


@pytest.fixture
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Endpoint, Endpoint]]:
    src_kind, dst_kind = getattr(request, "param", ("v2", "v2"))
    src, dst = python_endpoint(src_kind), python_endpoint(dst_kind)
    await src.xcvr.start()
    await dst.xcvr.start()
    yield src, dst
    await dst.xcvr.close()
    await src.xcvr.close()


@pytest.mark.parametrize(
    "pair", [("v1", "v1"), ("v2", "v2"), ("v1", "v2"), ("v2", "v1")], indirect=True
)
async def test_moves_kv_and_mamba_bytes_exactly_between_any_managers(
    pair: tuple[Endpoint, Endpoint],
) -> None:
    src, dst = pair
    free_before = src.manager.num_free_blocks
    sent = src.fill("r1", 3 * BLOCK_SIZE - 1)
    handle = TransferHandle.from_bytes(src.publish("r1").to_bytes())
    await dst.pull(handle, 3 * BLOCK_SIZE - 1)
    assert dst.segments("r1") == sent
    # (layer, block, head) KV pieces and (layer, kind) Mamba segments
    assert len(sent) == 2 * 3 * HYBRID.num_kv_heads + 2 * 2
    assert src.released == ["r1"]
    assert src.manager.num_free_blocks == free_before
    assert src.xcvr.num_pinned == 0
    src.manager.check_integrity()
    dst.manager.check_integrity()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu(1))])
async def test_staged_buffers_cross_chunk_boundaries(device: str) -> None:
    """Device pools (and host pools with staging forced) go through 8 MiB host chunks."""
    big = CacheSpec(num_kv_heads=16, head_dim=256, attention_layers=(0, 1))  # 256 KiB blocks
    src = python_endpoint("v2", big, device=device, stage=True, num_blocks=80)
    dst = python_endpoint("v1", big, device=device, stage=True, num_blocks=80)
    await src.xcvr.start()
    await dst.xcvr.start()
    try:
        num_tokens = 70 * BLOCK_SIZE  # ~17.5 MiB in one coalesced V2 range: three chunks
        sent = src.fill("r1", num_tokens)
        await dst.pull(src.publish("r1"), num_tokens)
        assert dst.segments("r1") == sent
        assert src.released == ["r1"]
    finally:
        await dst.xcvr.close()
        await src.xcvr.close()


async def test_scattered_destination_of_hundreds_of_pieces_lands_exactly() -> None:
    """More pieces in one receive than one system call takes."""
    big = CacheSpec(num_kv_heads=16, head_dim=256, attention_layers=(0, 1))
    src = python_endpoint("v1", big, num_blocks=260)
    dst = python_endpoint("v1", big, num_blocks=260)
    await src.xcvr.start()
    await dst.xcvr.start()
    try:
        singles = [f"single{i}" for i in range(dst.manager.num_free_blocks)]
        for rid in singles:
            assert dst.manager.allocate_slots(rid, BLOCK_SIZE)
        for rid in singles[::2]:  # the pull gets every other block
            dst.manager.free(rid)
        num_tokens = 120 * BLOCK_SIZE
        sent = src.fill("r1", num_tokens)
        await dst.pull(src.publish("r1"), num_tokens)
        assert dst.segments("r1") == sent
        blocks = dst.manager.regions("r1").block_ids
        assert all(y > x + 1 for x, y in zip(blocks, blocks[1:], strict=False))
    finally:
        await dst.xcvr.close()
        await src.xcvr.close()


async def test_payload_bytes_never_pass_through_python_memory() -> None:
    """Sent from views of the holder's pool, received straight into the puller's:
    Python memory stays below one 1 MiB (layer, block) segment during a 24 MiB pull."""
    big = CacheSpec(num_kv_heads=16, head_dim=256, attention_layers=(0, 1))

    def endpoint() -> Endpoint:
        return Endpoint("v1", lambda b: PythonTransceiver(b, SECRET), big, 32, num_blocks=26)

    src, dst = endpoint(), endpoint()
    await src.xcvr.start()
    await dst.xcvr.start()
    try:
        assert dst.manager.allocate_slots("spacer", 32)  # no range merges on both sides
        num_tokens = 12 * 32
        sent = src.fill("r1", num_tokens)
        handle = src.publish("r1")
        assert {len(b) for b in sent.values()} == {(1 << 20) // big.num_kv_heads}

        tracemalloc.start()
        try:
            await dst.pull(handle, num_tokens)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

        assert dst.segments("r1") == sent
        assert peak < 1 << 20, f"{peak} bytes of Python memory during a 24 MiB pull"
    finally:
        await dst.xcvr.close()
        await src.xcvr.close()


@pytest.mark.parametrize("pair", [("v2", "v2"), ("v1", "v2")], indirect=True)
async def test_offered_blocks_move_early_and_the_published_rest_releases(
    pair: tuple[Endpoint, Endpoint],
) -> None:
    await check_offered_blocks_then_the_rest(*pair)


async def test_many_concurrent_pulls_share_the_byte_budget(pair: tuple[Endpoint, Endpoint]) -> None:
    src, dst = pair
    src.xcvr._holder._budget.limit = 1024  # far below a request: forces interleaving
    sent = {f"r{i}": src.fill(f"r{i}", 2 * BLOCK_SIZE) for i in range(4)}
    handles = [src.publish(rid) for rid in sent]
    await asyncio.gather(*(dst.pull(h, 2 * BLOCK_SIZE) for h in handles))
    for rid, contents in sent.items():
        assert dst.segments(rid) == contents
    assert sorted(src.released) == sorted(sent)


async def test_lease_expiry_frees_unpulled_cache_and_late_pull_is_refused(
    pair: tuple[Endpoint, Endpoint],
) -> None:
    src, dst = pair
    free_before = src.manager.num_free_blocks
    src.fill("r1", BLOCK_SIZE)
    handle = src.publish("r1", lease_s=0.1)
    await asyncio.sleep(0.3)
    assert src.released == ["r1"]
    assert src.manager.num_free_blocks == free_before
    with pytest.raises(UnknownRequest, match="lease_s"):
        await dst.pull(handle, BLOCK_SIZE)
    assert not dst.manager.has_request("r1")
    dst.manager.check_integrity()


async def test_release_and_abort_are_idempotent(pair: tuple[Endpoint, Endpoint]) -> None:
    src, _ = pair
    src.fill("r1", BLOCK_SIZE)
    src.publish("r1")
    src.xcvr.abort("r1")
    src.xcvr.abort("r1")
    assert not src.xcvr.release("r1")
    assert src.released == ["r1"]
    src.manager.check_integrity()


async def test_layout_mismatch_names_the_field(pair: tuple[Endpoint, Endpoint]) -> None:
    src, _ = pair
    other = python_endpoint("v2", CacheSpec(num_kv_heads=2, head_dim=8, attention_layers=(1, 3)))
    await other.xcvr.start()
    try:
        src.fill("r1", BLOCK_SIZE)
        with pytest.raises(LayoutMismatch, match="mamba_layers"):
            await other.pull(src.publish("r1"), BLOCK_SIZE)
        assert src.xcvr.num_pinned == 1  # nothing moved, holder still pinned
    finally:
        await other.xcvr.close()


async def test_wrong_secret_is_refused_and_holder_stays_pinned(
    pair: tuple[Endpoint, Endpoint],
) -> None:
    src, _ = pair
    intruder = python_endpoint("v2", secret=b"guess")
    await intruder.xcvr.start()
    try:
        src.fill("r1", BLOCK_SIZE)
        with pytest.raises(WireError, match="secret"):
            await intruder.pull(src.publish("r1"), BLOCK_SIZE)
        assert src.xcvr.num_pinned == 1
    finally:
        await intruder.xcvr.close()


async def test_dead_holder_gives_peer_gone(pair: tuple[Endpoint, Endpoint]) -> None:
    src, dst = pair
    src.fill("r1", BLOCK_SIZE)
    handle = src.publish("r1")
    await src.xcvr.close()
    with pytest.raises(PeerGone, match="r1"):
        await dst.pull(handle, BLOCK_SIZE)
    assert not dst.manager.has_request("r1")


async def test_silent_holder_times_out_naming_the_setting(pair: tuple[Endpoint, Endpoint]) -> None:
    src, dst = pair
    src.fill("r1", BLOCK_SIZE)
    real = src.publish("r1")
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        handle = TransferHandle.from_dict({**real.to_dict(), "endpoint": silent.getsockname()})
        with pytest.raises(TransferTimeout, match="cache_transceiver.timeout_s"):
            await dst.pull(handle, BLOCK_SIZE, timeout_s=0.3)
    assert not dst.manager.has_request("r1")


async def test_abort_on_puller_cancels_its_pull(pair: tuple[Endpoint, Endpoint]) -> None:
    src, dst = pair
    src.fill("r1", BLOCK_SIZE)
    real = src.publish("r1")
    with socket.create_server(("127.0.0.1", 0)) as silent:
        stalled = TransferHandle.from_dict({**real.to_dict(), "endpoint": silent.getsockname()})
        pull = asyncio.create_task(dst.pull(stalled, BLOCK_SIZE))
        await asyncio.sleep(0.05)
        dst.xcvr.abort("r1")
        with pytest.raises(TransferAborted, match="r1"):
            await pull
    assert not dst.manager.has_request("r1")
    dst.manager.check_integrity()


def test_factory_refuses_an_unresolved_backend() -> None:
    buffers = allocate_cache_tensors(create_manager("v2", HYBRID, 4, BLOCK_SIZE, 1)).buffers()
    assert isinstance(create_transceiver("python", buffers, secret=SECRET), PythonTransceiver)
    with pytest.raises(ValueError, match="cache_transceiver.backend"):
        create_transceiver("auto", buffers, secret=SECRET)


async def test_leases_hold_whatever_the_wall_clocks_read(
    pair: tuple[Endpoint, Endpoint],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src, dst = pair
    real = time.time
    await check_skewed_wall_clocks(
        src, dst, lambda skew: monkeypatch.setattr(time, "time", lambda: real() + skew)
    )


# A head of a block is 4 x 256 float32 = 4 KiB: runs long enough to be
# received in place rather than through a staging chunk.
LONG_RUNS = CacheSpec(num_kv_heads=4, head_dim=256, attention_layers=(0, 1))


@pytest.mark.parametrize(
    "whole,ctx_size,gen_size,managers",
    [
        (HYBRID_WHOLE, 2, 1, ("v2", "v1")),
        (HYBRID_WHOLE, 1, 2, ("v1", "v2")),
        (HYBRID_WHOLE, 2, 2, ("v2", "v2")),
        (LONG_RUNS, 2, 1, ("v2", "v1")),
        (LONG_RUNS, 1, 2, ("v1", "v2")),
    ],
)
async def test_ranks_of_different_tensor_parallelism_exchange_head_slices(
    whole: CacheSpec, ctx_size: int, gen_size: int, managers: tuple[str, str]
) -> None:
    """Each generation rank pulls its heads from every context rank's handle;
    each holder is released once its pulls are done."""
    await check_head_slice_exchange(staged_endpoint, whole, ctx_size, gen_size, managers)


def staged_endpoint(manager: str, spec: CacheSpec, stage: bool, num_blocks: int) -> Endpoint:
    return python_endpoint(manager, spec, stage=stage, num_blocks=num_blocks)


# 16 heads of 256 float32 in blocks of 4 tokens: 256 KiB a block over both
# layers, so 80 blocks are 20 MiB and one rank's half of them two chunks.
WIDE_HEADS = CacheSpec(num_kv_heads=16, head_dim=256, attention_layers=(0, 1))


@pytest.mark.parametrize(
    "whole,ctx_size,gen_size,managers,staged,num_blocks",
    [
        # A head range of consecutive V1 blocks is strided on the side with
        # more heads: gathered on a staged holder, scattered on a staged puller.
        (HYBRID_WHOLE, 1, 2, ("v1", "v1"), (True, False), 3),
        (HYBRID_WHOLE, 2, 1, ("v1", "v1"), (False, True), 3),
        (HYBRID_WHOLE, 2, 1, ("v1", "v2"), (True, True), 3),
        # Runs long enough to be received in place, here through staging.
        (LONG_RUNS, 2, 1, ("v1", "v1"), (False, True), 3),
        # Megabytes of runs: chunk after chunk, each cut between whole runs.
        (WIDE_HEADS, 1, 2, ("v1", "v1"), (True, True), 80),
        (WIDE_HEADS, 2, 1, ("v2", "v2"), (True, True), 80),
    ],
)
async def test_head_slices_of_staged_pools_arrive_exactly(
    whole: CacheSpec,
    ctx_size: int,
    gen_size: int,
    managers: tuple[str, str],
    staged: tuple[bool, bool],
    num_blocks: int,
) -> None:
    """Tensor-parallel pulls between pools that pass through host staging,
    as GPU pools do (the holder's, the puller's or both)."""
    await check_head_slice_exchange(
        staged_endpoint, whole, ctx_size, gen_size, managers, staged, num_blocks
    )
