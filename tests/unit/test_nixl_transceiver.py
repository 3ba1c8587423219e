"""The NIXL transceiver with two agents in one process (UCX loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import pytest
import torch

from kvcache.spec import CacheSpec
from tests.head_shards import HYBRID_WHOLE, WholeCache, assert_equal, read, write
from tests.transfer_harness import (
    BLOCK_SIZE,
    Endpoint,
    check_offered_blocks_then_the_rest,
    check_skewed_wall_clocks,
)
from transfer.errors import LayoutMismatch, TransferAborted, UnknownRequest
from transfer.handle import TransferHandle
from transfer.nixl.puller import NixlPuller
from transfer.nixl.transceiver import NixlTransceiver, nixl_available

# nixl is part of the project's install: a build where it does not import fails here.
assert nixl_available(), "nixl does not import; `make install` installs it"


def nixl_endpoint(manager: str, block_size: int = BLOCK_SIZE) -> Endpoint:
    """A pool with a NIXL agent (not started)."""
    return Endpoint(manager, NixlTransceiver, block_size=block_size)


async def wait_for(condition: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:  # type: ignore[operator]
        await asyncio.sleep(0.01)


@pytest.fixture
async def workers() -> AsyncIterator[dict[str, Endpoint]]:
    pool = {
        "v1": nixl_endpoint("v1"),
        "v2": nixl_endpoint("v2"),
        "v2b": nixl_endpoint("v2"),
        "v1b": nixl_endpoint("v1"),
    }
    for worker in pool.values():
        await worker.xcvr.start()
    yield pool
    for worker in pool.values():
        await worker.xcvr.close()


@pytest.mark.parametrize("src_name,dst_name", [("v1", "v1b"), ("v2", "v2b")])
async def test_offered_blocks_move_early_and_the_published_rest_releases(
    workers: dict[str, Endpoint], src_name: str, dst_name: str
) -> None:
    await check_offered_blocks_then_the_rest(workers[src_name], workers[dst_name])


@pytest.mark.parametrize("src_name,dst_name", [("v1", "v1b"), ("v2", "v2b")])
async def test_moves_hybrid_cache_exactly_and_notification_releases_holder(
    workers: dict[str, Endpoint], src_name: str, dst_name: str
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
        assert dst.xcvr._endpoint.local is not None
        prepared.append(
            len(dst.xcvr._endpoint.local._handles)
            + len(dst.xcvr._endpoint.remote[src.xcvr.name]._handles)
        )
    assert src.manager.num_free_blocks == free_before
    # descriptor lists are prepared per pool, not per request
    assert prepared[0] > 0 and prepared[1] == prepared[0]
    src.manager.check_integrity()
    dst.manager.check_integrity()


@pytest.mark.parametrize("field", ["manager", "block_size"])
async def test_layout_mismatch_is_refused_before_any_byte_moves(
    workers: dict[str, Endpoint], field: str
) -> None:
    src = workers["v2"]
    dst = workers["v1"] if field == "manager" else nixl_endpoint("v2", block_size=2 * BLOCK_SIZE)
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


async def test_lease_expiry_frees_the_holder(workers: dict[str, Endpoint]) -> None:
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


async def test_a_pull_after_lease_expiry_fails_naming_the_lease_and_frees_its_destination(
    workers: dict[str, Endpoint],
) -> None:
    """The READs went out before the holder answered "expired": the pull
    still fails, and only once they are over, so the blocks freed hold
    whatever they brought and nothing lands later."""
    src, dst = workers["v2"], workers["v2b"]
    src.fill("r1", BLOCK_SIZE)
    handle = src.publish("r1", lease_s=0.05)
    await asyncio.sleep(0.1)
    free_before = dst.manager.num_free_blocks
    with pytest.raises(UnknownRequest, match="lease_s"):
        await dst.pull(handle, BLOCK_SIZE)
    assert dst.manager.num_free_blocks == free_before
    dst.manager.check_integrity()
    assert not dst.xcvr._puller._early_claims and not dst.xcvr._puller._claims
    settled = b"".join(t.numpy().tobytes() for t in dst.tensors.buffers().values())
    await asyncio.sleep(0.05)
    assert b"".join(t.numpy().tobytes() for t in dst.tensors.buffers().values()) == settled


async def test_reads_go_out_before_the_claim_is_answered(
    workers: dict[str, Endpoint], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grant's round trip does not sit in front of the READs: with the
    holder's answers held back, the puller's READ is posted anyway, and the
    pull completes once the grant comes."""
    src, dst = workers["v2"], workers["v2b"]
    sent = src.fill("r1", 2 * BLOCK_SIZE)
    handle = src.publish("r1")
    answers: list[tuple[Any, ...]] = []
    monkeypatch.setattr(src.xcvr._holder, "_send_answer", lambda *args: answers.append(args))
    posts: list[float] = []
    real_post = dst.xcvr._puller._post_reads

    def post(*args: Any) -> list[str]:
        posts.append(time.monotonic())
        return real_post(*args)

    monkeypatch.setattr(dst.xcvr._puller, "_post_reads", post)
    pull = asyncio.ensure_future(dst.pull(handle, 2 * BLOCK_SIZE))
    await wait_for(lambda: posts and answers)
    assert posts and answers and not pull.done()  # READ posted, grant held back
    monkeypatch.undo()
    src.xcvr._thread.submit(src.xcvr._holder._send_answer, *answers[0])
    await asyncio.wait_for(pull, 10)
    assert dst.segments("r1") == sent
    await wait_for(lambda: src.released == ["r1"])
    assert src.released == ["r1"]


async def test_abort_on_holder_releases_once(workers: dict[str, Endpoint]) -> None:
    src = workers["v2"]
    src.fill("r1", BLOCK_SIZE)
    src.publish("r1")
    src.xcvr.abort("r1")
    src.xcvr.abort("r1")
    assert not src.xcvr.release("r1")
    assert src.released == ["r1"]
    src.manager.check_integrity()


async def test_idle_agents_do_not_spin_a_core(workers: dict[str, Endpoint]) -> None:
    cpu_before, wall_before = time.process_time(), time.monotonic()
    await asyncio.sleep(1.0)
    cpu = time.process_time() - cpu_before
    # four agents with UCX progress threads; a zero poll delay would cost ~1 s each
    assert cpu < 0.5 * (time.monotonic() - wall_before)


async def test_a_request_nobody_claims_stops_the_fast_claim_poll() -> None:
    """A holder polls every 0.25 ms for a claim due right after a publish,
    not for the rest of the lease of a request whose puller never comes."""
    src = nixl_endpoint("v2")
    await src.xcvr.start()
    agent = src.xcvr._endpoint.agent
    polls: list[float] = []
    real_poll = agent.get_new_notifs

    def poll() -> Any:
        polls.append(time.monotonic())
        return real_poll()

    agent.get_new_notifs = poll
    try:
        assert src.manager.allocate_slots("never-claimed", 2 * BLOCK_SIZE)
        src.publish("never-claimed", lease_s=60.0)
        await asyncio.sleep(0.2)  # past the window in which a claim is due
        start = time.monotonic()
        await asyncio.sleep(1.0)
        late = [t for t in polls if t >= start]
        # every 5 ms at most ~200 polls a second; every 0.25 ms, thousands.
        # Counted, not timed by CPU use: a loaded machine only lowers the count.
        assert len(late) <= 1.2 * (time.monotonic() - start) / 0.005
        assert src.xcvr.release("never-claimed") and src.released == ["never-claimed"]
    finally:
        await src.xcvr.close()


# 4 attention layers x [2, 16, 8, 128] float32 = 512 KiB per block; 128 blocks = 64 MiB.
LARGE = CacheSpec(num_kv_heads=8, head_dim=128, attention_layers=(0, 1, 2, 3))
LARGE_BLOCKS = 128
LARGE_TOKENS = LARGE_BLOCKS * 16


@pytest.fixture
async def large() -> AsyncIterator[tuple[Endpoint, Endpoint]]:
    """A holder with 64 MiB of random KV published as "big", and a warmed-up puller."""
    src, dst = (
        Endpoint("v2", NixlTransceiver, spec=LARGE, block_size=16, num_blocks=2 * LARGE_BLOCKS + 1)
        for _ in range(2)
    )
    await src.xcvr.start()
    await dst.xcvr.start()
    for buffer in src.tensors.buffers().values():
        torch.randint(0, 256, buffer.shape, dtype=torch.uint8, out=buffer)
    assert src.manager.allocate_slots("warm", LARGE_TOKENS)
    await dst.pull(src.publish("warm"), LARGE_TOKENS)  # connects and prepares the tables
    dst.manager.free("warm")
    assert src.manager.allocate_slots("big", LARGE_TOKENS)
    yield src, dst
    await src.xcvr.close()
    await dst.xcvr.close()


async def max_loop_gap(work: Awaitable[None], tick_s: float = 0.001) -> tuple[float, float]:
    """Run `work` beside a ticker; returns (work seconds, longest gap between ticks)."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(tick_s)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticking = asyncio.create_task(ticker())
    await asyncio.sleep(5 * tick_s)
    start = time.perf_counter()
    try:
        await work
    finally:
        elapsed = time.perf_counter() - start
        done.set()
        await ticking
    return elapsed, max(gaps)


async def test_large_pull_keeps_the_event_loop_responsive(
    large: tuple[Endpoint, Endpoint],
) -> None:
    src, dst = large
    stalls = []
    for rid in ("big", "big.1", "big.2", "big.3", "big.4"):
        if rid != "big":
            assert src.manager.allocate_slots(rid, LARGE_TOKENS)
        source = src.manager.regions(rid)  # its bytes stay put after the holder frees it
        elapsed, gap = await max_loop_gap(dst.pull(src.publish(rid), LARGE_TOKENS))
        dest = dst.manager.regions(rid)
        for s, d in zip(source.descriptors, dest.descriptors, strict=True):
            assert torch.equal(src.tensors.region_tensor(s), dst.tensors.region_tensor(d))
        dst.manager.free(rid)
        stalls.append(f"{gap * 1e3:.1f} ms of {elapsed * 1e3:.1f} ms")
        # Posting the READ on the loop would stall it for the whole copy (gap ~
        # elapsed) in every pull; a pull of a few ms can also lose the core
        # to another process for most of it, so one clean pull of five shows it.
        if gap < 0.5 * elapsed:
            return
    pytest.fail(f"the loop stalled in every pull: {stalls}")


async def test_aborted_pull_returns_only_once_no_byte_can_land(
    large: tuple[Endpoint, Endpoint],
) -> None:
    src, dst = large
    handle = src.publish("big")
    assert dst.manager.allocate_for_transfer("big", LARGE_TOKENS)
    posting, posted = threading.Event(), threading.Event()
    post = dst.xcvr._endpoint.agent.transfer

    def transfer(*args: object) -> object:
        posting.set()
        try:
            return post(*args)
        finally:
            posted.set()

    dst.xcvr._endpoint.agent.transfer = transfer
    pull = asyncio.create_task(
        dst.xcvr.pull(handle, dst.manager.regions("big"), dst.manager.layout_signature(), 30)
    )
    while not posting.is_set():
        await asyncio.sleep(0.0002)
    dst.xcvr.abort("big")  # the 64 MiB READ is copying inside its post on the agent thread
    with pytest.raises(TransferAborted):
        await pull
    # The caller frees the blocks now, so the copy must be over.
    assert posted.is_set()
    dst.manager.free("big")
    await wait_for(lambda: "big" in src.released)
    assert src.released == ["warm", "big"] and src.xcvr.num_pinned == 0
    # The agent is usable after the cancelled post.
    assert src.manager.allocate_slots("again", LARGE_TOKENS)
    source = src.manager.regions("again")
    await dst.pull(src.publish("again"), LARGE_TOKENS)
    for s, d in zip(source.descriptors, dst.manager.regions("again").descriptors, strict=True):
        assert torch.equal(src.tensors.region_tensor(s), dst.tensors.region_tensor(d))


async def test_every_agent_call_runs_on_the_agent_thread(workers: dict[str, Endpoint]) -> None:
    src, dst = workers["v2"], workers["v2b"]
    threads = [record_agent_threads(src.xcvr), record_agent_threads(dst.xcvr)]
    sent = src.fill("r1", 2 * BLOCK_SIZE)
    await dst.pull(src.publish("r1"), 2 * BLOCK_SIZE)
    assert dst.segments("r1") == sent
    await wait_for(lambda: src.released == ["r1"])
    await dst.xcvr.close()
    await src.xcvr.close()
    for seen in threads:
        # One thread per agent (it runs without locks of its own), never the loop's.
        assert len(seen) == 1 and threading.get_ident() not in seen


def record_agent_threads(xcvr: NixlTransceiver) -> set[int]:
    """Wrap the agent's calls to collect the ids of the threads that make them."""
    seen: set[int] = set()
    agent = xcvr._endpoint.agent
    for name in (
        "make_prepped_xfer",
        "transfer",
        "check_xfer_state",
        "get_new_notifs",
        "send_notif",
        "add_remote_agent",
        "remove_remote_agent",
        "prep_xfer_dlist",
        "deregister_memory",
    ):
        method = getattr(agent, name)

        def recorded(*args: object, _method: Any = method, **kwargs: object) -> object:
            seen.add(threading.get_ident())
            return _method(*args, **kwargs)

        setattr(agent, name, recorded)
    return seen


async def test_leases_hold_whatever_the_wall_clocks_read(
    workers: dict[str, Endpoint],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src, dst = workers["v2"], workers["v2b"]
    real = time.time
    await check_skewed_wall_clocks(
        src,
        dst,
        lambda skew: monkeypatch.setattr(time, "time", lambda: real() + skew),
        reads_before_grant=True,
    )


@pytest.mark.parametrize("ctx_size,gen_size", [(2, 1), (1, 2), (2, 2)])
async def test_ranks_of_different_tensor_parallelism_read_head_slices(
    ctx_size: int, gen_size: int
) -> None:
    """Each generation rank READs its heads from every context rank; a holder
    is released once every puller rank is done."""
    cache = WholeCache(HYBRID_WHOLE, BLOCK_SIZE, num_blocks=3)
    num_tokens = 3 * BLOCK_SIZE - 1

    def endpoint(rank: int, size: int) -> Endpoint:
        spec = HYBRID_WHOLE.for_rank(rank, size)
        return Endpoint("v2", NixlTransceiver, spec, block_size=BLOCK_SIZE)

    holders = [endpoint(r, ctx_size) for r in range(ctx_size)]
    pullers = [endpoint(s, gen_size) for s in range(gen_size)]
    for worker in (*holders, *pullers):
        await worker.xcvr.start()
    try:
        handles = _publish_heads([*holders[1:], holders[0]], cache, num_tokens)
        for puller in pullers:
            assert puller.manager.allocate_slots("pad", BLOCK_SIZE)
            assert puller.manager.allocate_for_transfer("req", num_tokens)
            regions, signature = puller.manager.regions("req"), puller.manager.layout_signature()
            await puller.xcvr.pull_ranks(handles, regions, signature, timeout_s=10)
            got = read(puller.tensors, puller.manager, "req")
            assert_equal(got, cache.slice_for(puller.manager.layout.spec.heads))
        await wait_for(lambda: all(h.released for h in holders))
        assert [h.released for h in holders] == [["req"]] * ctx_size
    finally:
        for worker in (*pullers, *holders):
            await worker.xcvr.close()


def _publish_heads(
    holders: list[Endpoint], cache: WholeCache, num_tokens: int
) -> list[TransferHandle]:
    """Each holder rank writes its heads of `cache` as "req" and publishes
    it; the handles, in the order given (rank 0 last)."""
    handles = []
    for holder in holders:
        assert holder.manager.allocate_slots("req", num_tokens)
        write(
            holder.tensors, holder.manager, "req", cache.slice_for(holder.manager.layout.spec.heads)
        )
        handles.append(TransferHandle.from_bytes(holder.publish("req").to_bytes()))
    return handles


@contextlib.asynccontextmanager
async def _two_holder_ranks() -> AsyncIterator[tuple[list[Endpoint], Endpoint]]:
    """Holder ranks 1 and 0 of a TP 2 context instance (in publishing order)
    and one TP 1 puller, started; closed on the way out."""
    holders = [
        Endpoint("v2", NixlTransceiver, HYBRID_WHOLE.for_rank(r, 2), block_size=BLOCK_SIZE)
        for r in (1, 0)
    ]
    puller = Endpoint("v2", NixlTransceiver, HYBRID_WHOLE, block_size=BLOCK_SIZE)
    for worker in (*holders, puller):
        await worker.xcvr.start()
    try:
        yield holders, puller
    finally:
        for worker in (puller, *holders):
            await worker.xcvr.close()


async def test_the_holder_ranks_reads_are_posted_from_two_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over CPU memory a READ copies inside its post: two holder ranks' READs
    posted from two threads (each on a UCX worker of its own) copy side by
    side, and the bytes are the same as from one."""
    posting: list[str] = []
    post = NixlPuller._post_reads

    def recorded(self: NixlPuller, *args: Any) -> list[str]:
        posting.append(threading.current_thread().name)
        return post(self, *args)

    monkeypatch.setattr(NixlPuller, "_post_reads", recorded)
    cache = WholeCache(HYBRID_WHOLE, BLOCK_SIZE, num_blocks=3)
    async with _two_holder_ranks() as (holders, puller):
        handles = _publish_heads(holders, cache, 3 * BLOCK_SIZE - 1)
        assert puller.manager.allocate_for_transfer("req", 3 * BLOCK_SIZE - 1)
        regions, signature = puller.manager.regions("req"), puller.manager.layout_signature()
        await puller.xcvr.pull_ranks(handles, regions, signature, timeout_s=10)
        got = read(puller.tensors, puller.manager, "req")
        assert_equal(got, cache.slice_for(puller.manager.layout.spec.heads))
    assert len(posting) == 2 and len(set(posting)) == 2


async def test_a_holder_rank_gone_fails_the_pull_and_releases_the_other_ranks() -> None:
    """Every holder rank is claimed before the first READ; when one rank's
    lease is over, the pull fails and rank 0, already granted, is released
    at once rather than at the end of its lease."""
    async with _two_holder_ranks() as (holders, puller):
        handles = []
        for holder, lease_s in zip(holders, (0.05, 30.0), strict=True):
            holder.fill("req", BLOCK_SIZE)
            handles.append(TransferHandle.from_bytes(holder.publish("req", lease_s).to_bytes()))
        await asyncio.sleep(0.1)
        assert puller.manager.allocate_for_transfer("req", BLOCK_SIZE)
        regions, signature = puller.manager.regions("req"), puller.manager.layout_signature()
        with pytest.raises(UnknownRequest):
            await puller.xcvr.pull_ranks(handles, regions, signature, timeout_s=10)
        await wait_for(lambda: holders[1].released == ["req"])
        assert holders[1].released == ["req"] and holders[1].xcvr.num_pinned == 0
        assert not puller.xcvr._puller._early_claims and not puller.xcvr._puller._claims


async def test_an_aborted_pull_of_several_ranks_returns_once_no_read_can_land() -> None:
    """The holder ranks' READs overlap; an abort while the first one copies
    raises only once no READ of any rank is left in flight, and every holder
    rank is released at once."""
    async with _two_holder_ranks() as (holders, puller):
        handles = []
        for holder in holders:
            holder.fill("req", 2 * BLOCK_SIZE)
            handles.append(TransferHandle.from_bytes(holder.publish("req").to_bytes()))
        posting, go = threading.Event(), threading.Event()
        posts = {"started": 0, "returned": 0}
        post = puller.xcvr._endpoint.agent.transfer

        def transfer(*args: object) -> object:
            posts["started"] += 1
            posting.set()
            go.wait(5)  # the first post "copies" until the abort has run
            try:
                return post(*args)
            finally:
                posts["returned"] += 1

        puller.xcvr._endpoint.agent.transfer = transfer
        assert puller.manager.allocate_for_transfer("req", 2 * BLOCK_SIZE)
        regions, signature = puller.manager.regions("req"), puller.manager.layout_signature()
        pull = asyncio.create_task(puller.xcvr.pull_ranks(handles, regions, signature, 10))
        while not posting.is_set():
            await asyncio.sleep(0.0002)
        puller.xcvr.abort("req")
        asyncio.get_running_loop().call_later(0.05, go.set)  # the copy goes on a while
        with pytest.raises(TransferAborted):
            await pull
        # The caller frees the blocks now, so every post must be over.
        assert posts["started"] == posts["returned"] >= 1
        puller.manager.free("req")
        await wait_for(lambda: all(h.released == ["req"] for h in holders))
        assert [h.released for h in holders] == [["req"], ["req"]]
        assert all(h.xcvr.num_pinned == 0 for h in holders)
        assert not puller.xcvr._puller._early_claims and not puller.xcvr._puller._claims


async def test_a_claim_sent_ahead_is_granted_before_the_destination_exists(
    workers: dict[str, Endpoint],
) -> None:
    """`claim_ahead` pins the holder's lease while the puller still has no
    blocks; the pull that follows reads under that grant and releases."""
    src, dst = workers["v2"], workers["v2b"]
    sent = src.fill("r1", 2 * BLOCK_SIZE)
    handle = TransferHandle.from_bytes(src.publish("r1").to_bytes())
    assert src.xcvr._leases.num_unclaimed == 1
    dst.xcvr.claim_ahead([handle])
    await wait_for(lambda: src.xcvr._leases.num_unclaimed == 0)
    assert src.xcvr._leases.num_unclaimed == 0 and src.xcvr.num_pinned == 1
    assert dst.manager.allocate_for_transfer("r1", 2 * BLOCK_SIZE)
    regions, signature = dst.manager.regions("r1"), dst.manager.layout_signature()
    await dst.xcvr.pull_ranks([handle], regions, signature, timeout_s=10)
    assert dst.segments("r1") == sent
    await wait_for(lambda: src.released == ["r1"])
    assert src.released == ["r1"]
    assert not dst.xcvr._puller._early_claims and not dst.xcvr._puller._claimed_ahead


async def test_an_abort_before_the_pull_drops_the_claim_and_frees_the_holder(
    workers: dict[str, Endpoint],
) -> None:
    src, dst = workers["v2"], workers["v2b"]
    src.fill("r1", BLOCK_SIZE)
    handle = TransferHandle.from_bytes(src.publish("r1", lease_s=30.0).to_bytes())
    dst.xcvr.claim_ahead([handle])
    await wait_for(lambda: src.xcvr._leases.num_unclaimed == 0)
    dst.xcvr.abort("r1")
    assert not dst.xcvr._puller._early_claims and not dst.xcvr._puller._claimed_ahead
    await wait_for(lambda: src.released == ["r1"])  # long before the lease ends
    assert src.released == ["r1"] and src.xcvr.num_pinned == 0
    src.manager.check_integrity()
