"""A cache pool with a transceiver, for transceiver tests of every backend.

`Endpoint` holds what one worker holds: a manager, its pool tensors and a
transceiver built over the pool's buffers. `fill` writes random bytes into a
request's segments, `segments` reads them back, and `publish` / `pull` run
the two sides of a transfer the way the workers do (the puller frees its
blocks when the pull fails).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping

import torch

from kvcache.factory import create_manager
from kvcache.manager import KVCacheManager
from kvcache.spec import CacheSpec
from kvcache.tensors import CacheTensors, allocate_cache_tensors
from tests.head_shards import WholeCache, assert_equal, read, write
from transfer.base import Transceiver
from transfer.handle import TransferHandle

HYBRID = CacheSpec(
    num_kv_heads=2,
    head_dim=8,
    attention_layers=(1, 3),
    mamba_layers=(0, 2),
    conv_state_shape=(12, 3),
    ssm_state_shape=(2, 4, 8),
)
BLOCK_SIZE = 4

TransceiverFactory = Callable[[Mapping[str, torch.Tensor]], Transceiver]


class Endpoint:
    """A manager, its pool tensors and a transceiver over them (not started)."""

    def __init__(
        self,
        manager: str,
        make_transceiver: TransceiverFactory,
        spec: CacheSpec = HYBRID,
        block_size: int = BLOCK_SIZE,
        num_blocks: int = 16,
        device: str = "cpu",
    ) -> None:
        self.manager: KVCacheManager = create_manager(manager, spec, num_blocks, block_size, 4)
        self.tensors: CacheTensors = allocate_cache_tensors(self.manager, device)
        self.xcvr = make_transceiver(self.tensors.buffers())
        self.released: list[str] = []

    def fill(self, request_id: str, num_tokens: int) -> dict[object, bytes]:
        """Allocate a request and write random bytes into all its segments."""
        assert self.manager.allocate_slots(request_id, num_tokens)
        regions = self.manager.regions(request_id)
        contents: dict[object, bytes] = {}
        for key, region in regions.contiguous_segments().items():
            data = torch.randint(0, 256, (region.length,), dtype=torch.uint8).numpy().tobytes()
            self.tensors.write_region(region, data)
            contents[key] = data
        return contents

    def segments(self, request_id: str) -> dict[object, bytes]:
        regions = self.manager.regions(request_id)
        return {
            key: self.tensors.read_region(region)
            for key, region in regions.contiguous_segments().items()
        }

    def publish(self, request_id: str, lease_s: float = 30.0) -> TransferHandle:
        def on_release(rid: str) -> None:
            self.released.append(rid)
            self.manager.free(rid)

        return self.xcvr.publish(
            request_id,
            self.manager.regions(request_id),
            self.manager.layout_signature(),
            lease_s,
            on_release,
        )

    async def pull(self, handle: TransferHandle, num_tokens: int, timeout_s: float = 10) -> None:
        rid = handle.request_id
        assert self.manager.allocate_for_transfer(rid, num_tokens)
        try:
            await self.xcvr.pull(
                handle, self.manager.regions(rid), self.manager.layout_signature(), timeout_s
            )
        except BaseException:
            self.manager.free(rid)
            raise
        self.manager.finish_transfer(rid)


async def check_skewed_wall_clocks(
    src: Endpoint,
    dst: Endpoint,
    skew_clock: Callable[[float], None],
    reads_before_grant: bool = False,
) -> None:
    """Leases hold whatever the wall clocks read: `skew_clock(seconds)` moves
    `time.time()` after the holder published, as a puller on a node whose clock
    differs by that much would see it.

    A clock an hour behind must not make a puller take an expired request's
    blocks, which the holder has meanwhile handed to another request, for its
    own; a clock an hour ahead must not make it refuse a live one. A puller
    that reads before the holder's answer (`reads_before_grant`, NIXL) may
    bring the other request's bytes into its destination, but the pull fails
    and those blocks are free again; any other never receives them.
    """
    from transfer.errors import UnknownRequest

    src.fill("expired", BLOCK_SIZE)
    late = src.publish("expired", lease_s=0.05)
    while "expired" not in src.released:
        await asyncio.sleep(0.01)
    reused = src.fill("reuser", BLOCK_SIZE)  # the freed blocks, new bytes
    free_before = dst.manager.num_free_blocks
    skew_clock(-3600.0)
    try:
        await dst.pull(late, BLOCK_SIZE)
    except UnknownRequest:
        pass
    else:
        raise AssertionError("a pull behind the holder's clock read a freed request")
    assert dst.manager.num_free_blocks == free_before
    dst.manager.check_integrity()
    if not reads_before_grant:
        seen = b"".join(t.numpy().tobytes() for t in dst.tensors.buffers().values())
        assert not any(chunk in seen for chunk in reused.values() if any(chunk))
    skew_clock(+3600.0)
    sent = src.fill("live", BLOCK_SIZE)
    await dst.pull(src.publish("live", lease_s=30.0), BLOCK_SIZE)
    assert dst.segments("live") == sent


async def check_offered_blocks_then_the_rest(src: Endpoint, dst: Endpoint) -> None:
    """Chunk-pipelined transfer: blocks offered while the prompt prefills move
    with `pull(release=False)` and pin nothing; once published under the same
    transfer id, the rest and the Mamba state move and release the holder. A
    withdrawn offer is quiet at once (nothing reads it) and refuses later pulls."""
    from transfer.errors import UnknownRequest

    num_tokens = 3 * BLOCK_SIZE - 1
    sent = src.fill("r", num_tokens)
    src_layout, dst_layout = src.manager.layout, dst.manager.layout
    signature = dst.manager.layout_signature()
    table = src.manager.block_table("r")
    offered = src.xcvr.offer(
        "r", src_layout.request_regions(table[:2], None), src.manager.layout_signature()
    )
    assert dst.manager.allocate_for_transfer("r", num_tokens)
    dest = dst.manager.block_table("r")
    first = dst_layout.request_regions(dest[:2], None)
    await dst.xcvr.pull(offered, first, signature, 10, release=False)
    assert src.xcvr.num_pinned == 0 and src.released == []
    whole = src.publish("r")
    assert whole.transfer_id == offered.transfer_id
    rest = src_layout.request_regions(table[2:], whole.regions.mamba_slot)
    dest_rest = dst_layout.request_regions(dest[2:], dst.manager.mamba_slot("r"))
    await dst.xcvr.pull(dataclasses.replace(whole, regions=rest), dest_rest, signature, 10)
    dst.manager.finish_transfer("r")
    assert dst.segments("r") == sent
    for _ in range(500):  # NIXL's release notification arrives on its own time
        if src.released:
            break
        await asyncio.sleep(0.01)
    assert src.released == ["r"]

    src.fill("w", BLOCK_SIZE)
    withdrawn = src.xcvr.offer(
        "w", src_layout.request_regions(src.manager.block_table("w"), None), signature
    )
    quiet: list[str] = []
    src.xcvr.withdraw("w", lambda: quiet.append("w"))
    assert quiet == ["w"]
    assert dst.manager.allocate_for_transfer("w", BLOCK_SIZE)
    regions = dst_layout.request_regions(dst.manager.block_table("w"), None)
    try:
        await dst.xcvr.pull(withdrawn, regions, signature, 10, release=False)
    except UnknownRequest:
        pass
    else:
        raise AssertionError("a withdrawn offer was read")
    for endpoint in (src, dst):
        endpoint.manager.free("w")
        endpoint.manager.check_integrity()


# A staged flag -> an endpoint of a manager over a rank's spec, with a number of blocks.
StagedEndpoint = Callable[[str, CacheSpec, bool, int], Endpoint]


async def check_head_slice_exchange(
    make: StagedEndpoint,
    whole: CacheSpec,
    ctx_size: int,
    gen_size: int,
    managers: tuple[str, str],
    staged: tuple[bool, bool] = (False, False),
    num_blocks: int = 3,
) -> None:
    """Each generation rank pulls its heads from every context rank's handle
    and holds exactly its slice of the whole cache; each holder is released
    once all its pulls are done. `staged` forces the holders' and the
    pullers' pools through host staging, as device pools go."""
    cache = WholeCache(whole, BLOCK_SIZE, num_blocks=num_blocks)
    num_tokens = num_blocks * BLOCK_SIZE - 1
    pool_blocks = num_blocks + 2
    holders = [
        make(managers[0], whole.for_rank(r, ctx_size), staged[0], pool_blocks)
        for r in range(ctx_size)
    ]
    pullers = [
        make(managers[1], whole.for_rank(s, gen_size), staged[1], pool_blocks)
        for s in range(gen_size)
    ]
    for worker in (*holders, *pullers):
        await worker.xcvr.start()
    try:
        handles = []
        for holder in holders:
            assert holder.manager.allocate_slots("req", num_tokens)
            part = cache.slice_for(holder.manager.layout.spec.heads)
            write(holder.tensors, holder.manager, "req", part)
            handles.append(TransferHandle.from_bytes(holder.publish("req").to_bytes()))
        for puller in pullers:
            assert puller.manager.allocate_slots("pad", BLOCK_SIZE)
            assert puller.manager.allocate_for_transfer("req", num_tokens)
            for handle in handles:
                await puller.xcvr.pull(
                    handle,
                    puller.manager.regions("req"),
                    puller.manager.layout_signature(),
                    timeout_s=30,
                )
            got = read(puller.tensors, puller.manager, "req")
            assert_equal(got, cache.slice_for(puller.manager.layout.spec.heads))
            # A holder stays pinned until every puller rank has pulled it.
            last = puller is pullers[-1]
            assert [h.released for h in holders] == [["req"] if last else []] * ctx_size
    finally:
        for worker in (*pullers, *holders):
            await worker.xcvr.close()
