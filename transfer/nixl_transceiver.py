"""The NIXL transceiver: one agent per worker, generation side READs, a notification releases.

    holder (context)                         puller (generation)
    register pool buffers once               register pool buffers once
    publish -> handle {agent name,           pull: signatures equal? else LayoutMismatch
        metadata, buffer addresses,                load holder metadata (once per peer)
        descriptors}        --- Ray --->           READ descriptor indices from tables
                                                   prepared once per (peer, buffer)
    lease live? pin it    <--- notif ---           "claim <rid> <tid> <metadata>", then READ
    for a window W        --- notif --->           "grant <rid> <tid> <W>" (or "expired"):
                                                   the READs count if done within W of
                                                   sending the claim
    poll notifications   <--- notif ---            "release <rid> <tid> <rank> <of>" when
    -> on_release(rid) once all                    all READs done
       `of` puller ranks released

The generation worker claims ahead (`claim_ahead`), as soon as the request
reaches it: the grant's round trip overlaps the wait for destination blocks,
and a holder polls every 0.25 ms while a published request awaits its claim.

Offered blocks of a prompt still prefilling (`transfer.offers`) are claimed
the same way; the puller ends such a pull with "done <rid> <tid>" instead of
"release", which closes that claim's window early and keeps the request.

NIXL moves raw memory by descriptor, so both sides must lay their cache out
identically (same manager, dtype, block size, layers): the signature is
compared before any byte moves. V1 <-> V2 needs the Python transceiver.
Between ranks of different tensor parallelism a READ descriptor is one run of
a head slice (`transfer.head_slices`): the K or the V heads a puller rank
takes from one block of one layer (longer where runs join up on both sides),
or one section of a Mamba state; its tables are prepared per (buffer, run
length, phase) like the whole-block ones. A pull from several holder ranks
(`pull_ranks`) claims them all at once and overlaps their READs: each rank's
are posted once planned, the next rank is planned while they copy, and the
holders are released in order, rank 0 last, once every READ is done.

Every call on the agent runs on the transceiver's own `AgentThread`, never on
the event loop: over UCX on CPU a READ copies inside its post, and a pull in
flight must not stall the running batch. Lease and bookkeeping state stays on
the loop; the agent, its prepared tables and the peer maps stay on the thread.
A pull that fails, times out or is aborted raises only once its READs are
over or released, since its caller frees the destination blocks right after.

READs are one-sided, so the holder cannot see them. The puller claims the
request and posts its READs without waiting for the answer; the holder,
whose monotonic clock alone decides whether the lease is still live, answers
"expired" or pins the blocks for a window W past the lease. A lease never
comes back, so a grant means the blocks held the request's bytes from
publish until the answer and stay pinned for W after: READs done within the
window read the request. The puller counts W on its own monotonic clock from
*before* it sent the claim, so its window closes before the holder's does
whatever the two clocks read (only their rates must agree); READs not done
by then are released and the pull fails with `UnknownRequest`, as it does on
"expired" once its READs are over (what they brought lands only in blocks the
caller frees). A holder that aborts a request while a READ is in flight still
cannot stop it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvcache.layout import LayoutSignature, RequestRegions
from transfer.base import (
    BufferInfo,
    Transceiver,
    TransferHandle,
    check_signature,
    parse_signature,
)
from transfer.errors import LayoutMismatch, PeerGone, TransferError, UnknownRequest
from transfer.head_slices import check_shards, plan_head_slices, same_heads
from transfer.nixl_agent import (
    DEFAULT_PROGRESS_DELAY_US,
    AgentThread,
    create_agent,
    nixl_available,
)
from transfer.nixl_descriptors import (
    PairGroups,
    PreparedTables,
    group_pairs,
    group_slice_pairs,
)
from transfer.offers import Offer
from transfer.plan import check_bounds

__all__ = ["DEFAULT_PROGRESS_DELAY_US", "NixlTransceiver", "create_agent", "nixl_available"]

logger = logging.getLogger(__name__)

_RELEASE = b"release"
_CLAIM = b"claim"
_GRANT = b"grant"
_EXPIRED = b"expired"
_DONE = b"done"  # READs of offered blocks finished; the holder keeps the request
_LOCAL_AGENT = "NIXL_INIT_AGENT"
# Notification polls of an agent with nothing pinned or claimed.
_IDLE_POLL_INTERVAL_S = 0.05
# ... and of a holder with a published request not yet claimed: the first
# token has reached the caller, who now waits on this round trip, and a claim
# is due within milliseconds. The puller's READs are done long before the
# grant comes for a small request, so this poll sets its pull's time: a
# one-block bench-transfer pull took 2.4-4.4 ms (p50) polling every 1 ms and
# 1.3-1.6 ms every 0.25 ms. The holder polls this fast only until the claim
# comes (in serving the generation worker claims ahead, as soon as the
# request reaches it): four polls, each a hop to the agent thread, for every
# millisecond the claim takes.
_CLAIM_POLL_INTERVAL_S = 0.00025
# ... and of a puller waiting for a grant: the holder answers within its own
# poll, so the grant is due within about a millisecond, and the READs wait on
# it (a 64 MiB READ takes ~10 ms on CPU). Such a wait is short and rare enough
# that polling it finely costs little CPU.
_GRANT_POLL_INTERVAL_S = 0.0002
# Completion polls of a READ still in flight (RDMA, GPU) sleep a small fraction
# of its age, so a short READ is seen done within microseconds and a long one
# costs at most one poll per `_MAX_POLL_GAP_S`.
_POLL_FRACTION = 0.05
_MAX_POLL_GAP_S = 0.0005
# Binding exceptions (no common base class) that mean the holder is unreachable.
_PEER_ERRORS = frozenset({"nixlRemoteDisconnectError", "nixlBackendError"})


class NixlTransceiver(Transceiver):
    """NIXL transceiver over the worker's registered buffers (CPU or CUDA).

    buffers: name -> flat uint8 tensor (`CacheTensors.buffers()`), registered
        once as DRAM or VRAM.
    name: the agent name, unique in the cluster (a random one by default).
    poll_interval_s: how often notifications are polled while requests are
        pinned here and claimed (every 0.2 ms while a claim of ours awaits
        its grant, every 0.25 ms while a published request awaits its claim,
        every 50 ms otherwise).
    claim_window_s: how long a granted claim pins a request for its READs.
    """

    kind = "nixl"

    def __init__(
        self,
        buffers: Mapping[str, torch.Tensor],
        name: str | None = None,
        progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
        poll_interval_s: float = 0.005,
        claim_window_s: float = 30.0,
    ) -> None:
        super().__init__()
        self._tensors = dict(buffers)
        self.name = name or f"disagg-{uuid.uuid4().hex[:12]}"
        self._progress_delay_us = progress_delay_us
        self._poll_interval_s = poll_interval_s
        self._claim_window_s = claim_window_s
        # Puller: claims sent and not yet answered, by (request id, transfer id).
        self._claims: dict[tuple[str, str], asyncio.Future[float | None]] = {}
        # Puller: claims `pull_ranks` sent ahead, (sent at, granted window), by (rid, tid).
        self._early_claims: dict[tuple[str, str], asyncio.Task[tuple[float, float]]] = {}
        # Puller: handles of `claim_ahead` whose `pull_ranks` has not begun, by request id.
        self._claimed_ahead: dict[str, list[TransferHandle]] = {}
        self._thread = AgentThread(f"nixl-{self.name}")
        # Owned by the agent thread from start() to close():
        self._agent: Any = None
        self._registered: list[Any] = []
        self._local: PreparedTables | None = None
        self._remote: dict[str, PreparedTables] = {}
        self._remote_metadata: dict[str, bytes] = {}
        self._claimants: dict[str, bytes] = {}  # pullers loaded to answer their claims
        self._metadata = b""
        self._buffers = {n: _buffer_info(t) for n, t in self._tensors.items()}
        self._sizes = {n: b.num_bytes for n, b in self._buffers.items()}
        self._mem_type = _mem_type(self._tensors)
        self._poller: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()  # set: poll now, without finishing the wait
        # Holder: claim windows open on offers, oldest first, by (request id, transfer id).
        self._windows: dict[tuple[str, str], deque[tuple[Offer, asyncio.TimerHandle]]] = {}

    async def start(self) -> None:
        await self._thread.run(self._start_agent)

    async def close(self) -> None:
        tasks = [t for t in [self._poller, *self._pulls.values()] if t is not None]
        for task in tasks:
            task.cancel()
        # A cancelled pull returns once its READs are released, before the agent closes.
        await asyncio.gather(*tasks, return_exceptions=True)
        self._leases.release_all()
        for rid, tid in list(self._windows):  # no READ reaches a closed agent
            while (rid, tid) in self._windows:
                self._close_window(rid, tid)
        if self._agent is not None:
            await self._thread.run(self._close_agent)
        self._thread.shutdown()

    def publish(
        self,
        request_id: str,
        regions: RequestRegions,
        signature: LayoutSignature,
        lease_s: float,
        on_release: Callable[[str], None],
    ) -> TransferHandle:
        if self._agent is None:
            raise RuntimeError("NixlTransceiver.start() has not run")
        check_bounds(request_id, regions.descriptors, self._sizes)
        tid = self._transfer_id_for(request_id)
        self._leases.add(request_id, tid, lease_s, on_release)
        return self._handle(request_id, tid, regions, signature)

    def _handle(
        self,
        request_id: str,
        transfer_id: str,
        regions: RequestRegions,
        signature: LayoutSignature,
    ) -> TransferHandle:
        self._ensure_poller()
        return TransferHandle(
            request_id=request_id,
            transfer_id=transfer_id,
            kind=self.kind,
            regions=regions,
            signature=signature.to_dict(),
            agent_name=self.name,
            agent_metadata=self._metadata,
            buffers=dict(self._buffers),
        )

    def _stop_reads(self, request_id: str) -> None:
        """READs are one-sided: an offer's claim windows end them (or their
        "done" notifications, sooner)."""

    # ----------------------------------------------------------------- holder

    def _ensure_poller(self) -> None:
        """Start the poller, or cut its current wait short: a publish, an offer
        or a claim expects notifications soon, and an idle wait is long."""
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll_notifications())
        self._wake.set()

    async def _poll_notifications(self) -> None:
        """Apply notifications from the first publish or claim until `close`.

        Slowly while nothing is pinned or claimed: a late claim of an expired
        lease must still get its answer.
        """
        while True:
            self._wake.clear()
            notifications = await self._thread.run(self._agent.get_new_notifs)
            for sender, messages in notifications.items():
                for message in messages:
                    self._apply_notification(sender, message)
            busy = len(self._leases) or self._offers
            interval = _IDLE_POLL_INTERVAL_S
            if self._claims:
                interval = min(_GRANT_POLL_INTERVAL_S, self._poll_interval_s)
            elif self._leases.num_unclaimed:
                interval = min(_CLAIM_POLL_INTERVAL_S, self._poll_interval_s)
            elif busy:
                interval = self._poll_interval_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval)

    def _apply_notification(self, sender: str, message: bytes) -> None:
        kind, _, rest = message.partition(b" ")
        parts = rest.split(b" ", 2)
        if kind == _RELEASE and len(parts) == 2:  # an aborted pull: release now
            self._leases.release(parts[0].decode(), parts[1].decode())
        elif kind == _DONE and len(parts) == 2:
            self._close_window(parts[0].decode(), parts[1].decode())
        elif kind == _RELEASE and len(parts) == 3:
            rank, of = (int(n) for n in parts[2].split())
            self._leases.release_by(parts[0].decode(), parts[1].decode(), rank, of)
        elif kind == _CLAIM and len(parts) == 3:
            self._answer_claim(sender, parts[0].decode(), parts[1].decode(), parts[2])
        elif kind in (_GRANT, _EXPIRED) and len(parts) >= 2:
            rid, tid = parts[0].decode(), parts[1].decode()
            claim = self._claims.get((rid, tid))
            if claim is not None and not claim.done():
                claim.set_result(float(parts[2]) if kind == _GRANT else None)
            elif kind == _GRANT:  # the pull was cancelled meanwhile: end the window
                self._thread.submit(self._send_done, sender, rid, tid)
        else:
            logger.warning("ignoring unexpected NIXL notification %r", message[:64])

    def _answer_claim(self, puller: str, rid: str, tid: str, metadata: bytes) -> None:
        """Grant a live lease's or offer's blocks to a puller for the claim
        window, or say it expired."""
        lease = self._leases.get(rid, tid)
        offer = self._offers.get(rid)
        ids = [rid.encode(), tid.encode()]
        loop = asyncio.get_running_loop()
        if lease is not None:
            # An expiry meanwhile is deferred until the window ends (or the release).
            self._leases.begin_stream(lease)
            loop.call_later(self._claim_window_s, self._leases.end_stream, lease)
        elif offer is not None and offer.transfer_id == tid:
            # A withdrawal meanwhile waits for the window (or the puller's "done").
            offer.begin_read()
            timer = loop.call_later(self._claim_window_s, self._close_window, rid, tid)
            self._windows.setdefault((rid, tid), deque()).append((offer, timer))
        else:
            self._thread.submit(self._send_answer, puller, metadata, b" ".join([_EXPIRED, *ids]))
            return
        answer = b" ".join([_GRANT, *ids, repr(self._claim_window_s).encode()])
        self._thread.submit(self._send_answer, puller, metadata, answer)

    def _close_window(self, rid: str, tid: str) -> None:
        """End the oldest open claim window on an offer of (rid, tid), if any."""
        windows = self._windows.get((rid, tid))
        if not windows:
            return
        offer, timer = windows.popleft()
        if not windows:
            del self._windows[(rid, tid)]
        timer.cancel()
        offer.end_read()

    # ----------------------------------------------------------------- puller

    async def pull_ranks(
        self,
        handles: Sequence[TransferHandle],
        dest_regions: RequestRegions,
        dest_signature: LayoutSignature,
        timeout_s: float,
    ) -> None:
        """`Transceiver.pull_ranks`, with the holder ranks' pulls overlapped.

        Every layout is checked first, so a mismatch never reaches a holder;
        then every rank is claimed at once, and each rank's READs are planned
        while the claims and the earlier ranks' READs are in flight and
        posted once planned (the agent thread runs them back to
        back). The holders are released in order, rank 0 last, once every
        READ is done: rank 0 frees the blocks of all ranks. A failure stops
        the other ranks' READs and waits for them before it raises."""
        if not handles:
            return
        for handle in handles:
            self._check_kind(handle)
            self._claimed_ahead.pop(handle.request_id, None)  # this pull ends those claims
        pull = self._pull_all(handles, dest_regions, dest_signature)
        try:
            await self._guard(handles, pull, timeout_s)
        finally:
            await self._drop_claims(handles)

    def claim_ahead(self, handles: Sequence[TransferHandle]) -> None:
        """Claim now: the grant's round trip overlaps the wait for the destination."""
        for handle in self._claim_each(handles):
            self._claimed_ahead.setdefault(handle.request_id, []).append(handle)

    def _claim_each(self, handles: Sequence[TransferHandle]) -> list[TransferHandle]:
        """Send a claim for each NIXL handle not claimed yet; the handles claimed."""
        claimed = []
        for handle in handles:
            key = (handle.request_id, handle.transfer_id)
            if handle.kind != self.kind or handle.agent_name is None or key in self._early_claims:
                continue
            task = asyncio.ensure_future(self._timed_claim(handle))
            task.add_done_callback(_retrieve)  # a claim given up on may have failed
            self._early_claims[key] = task
            claimed.append(handle)
        return claimed

    def abort(self, request_id: str) -> None:
        """`Transceiver.abort`; claims sent ahead of a pull that never began
        are dropped and their holders told to free."""
        super().abort(request_id)
        for handle in self._claimed_ahead.pop(request_id, []):
            early = self._early_claims.pop((handle.request_id, handle.transfer_id), None)
            if early is not None:
                early.cancel()
                self._notify_abort(handle)

    async def _timed_claim(self, handle: TransferHandle) -> tuple[float, float]:
        """(when the claim left, the window granted); see `_claim`."""
        claimed_at = time.monotonic()
        return claimed_at, await self._claim(handle)

    async def _pull(
        self,
        handle: TransferHandle,
        dest_regions: RequestRegions,
        dest: LayoutSignature,
        release: bool,
    ) -> None:
        source = self._check_layout(handle, dest)
        self._claimed_ahead.pop(handle.request_id, None)  # a plain `pull` after `claim_ahead`
        try:
            await self._send_claims([handle])  # its round trip overlaps the planning
            groups = self._plan(handle, source, dest_regions, dest)
            xfers = await self._read(handle, groups, release)
        finally:
            await self._drop_claims([handle])
        # The holder learns in the background; the caller has its bytes now.
        self._thread.submit(self._finish, xfers, handle, dest, release)

    async def _pull_all(
        self, handles: Sequence[TransferHandle], dest_regions: RequestRegions, dest: LayoutSignature
    ) -> None:
        """`pull_ranks`' body: every handle's READs, then every release."""
        sources = [self._check_layout(handle, dest) for handle in handles]
        await self._send_claims(handles)
        reads: list[asyncio.Task[list[Any]]] = []
        try:
            for handle, source in zip(handles, sources, strict=True):
                groups = self._plan(handle, source, dest_regions, dest)
                posted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                read = asyncio.ensure_future(self._read(handle, groups, True, posted))
                read.add_done_callback(functools.partial(_settle_after, posted))
                reads.append(read)
                # Plan the next rank while this one's READs copy (the post
                # releases the GIL), not while its grant waits for the loop.
                if handle is not handles[-1]:
                    await posted
                    if read.done():  # it failed before its post: read no further rank
                        break
            done = await asyncio.gather(*reads)
        except BaseException:
            # All or none: no READ may land once this raises, since the
            # caller frees the destination blocks. A read cancelled once
            # (the gather above does so) is waiting for its READs to end: a
            # second cancel would cut that wait short.
            for read in reads:
                if not read.cancelling():
                    read.cancel()
            await _wait_all(reads)
            raise
        for handle, xfers in zip(handles, done, strict=True):
            self._thread.submit(self._finish, xfers, handle, dest, True)

    async def _send_claims(self, handles: Sequence[TransferHandle]) -> None:
        """Claim each handle not claimed yet, and return once the claims' sends
        are queued on the agent thread, which runs jobs in order: ahead of
        any READ posted after this returns."""
        if self._claim_each(handles):
            await asyncio.sleep(0)  # each claim task runs up to its queued send

    async def _drop_claims(self, handles: Sequence[TransferHandle]) -> None:
        """Forget claims of `handles` no READ took (a pull failed before it):
        their holders are told to release by the pull's failure, so only the
        local futures are left."""
        for handle in handles:
            early = self._early_claims.pop((handle.request_id, handle.transfer_id), None)
            if early is not None:
                early.cancel()
                await asyncio.gather(early, return_exceptions=True)

    async def _read(
        self,
        handle: TransferHandle,
        groups: PairGroups,
        release: bool,
        posted: asyncio.Future[None] | None = None,
    ) -> list[Any]:
        """Post the READs of `groups` (settling `posted` as the agent thread
        enters the post) and wait for them and for `handle`'s grant; the
        finished READs, for `_finish`. Raises only once no READ of this handle
        can land any more.

        The READs go out without waiting for the grant, whose round trip
        would otherwise sit in front of every pull. That is sound because
        a lease never comes back: a grant means the holder kept the blocks
        for the request from publish until it answered, and pins them for the
        window after, so READs done within the window saw the request's bytes.
        An "expired" answer fails the pull once its READs are over; the bytes
        they brought land only in destination blocks the caller then frees."""
        # Counted from before the claim left, so it ends before the holder's window.
        claim = self._early_claims.pop((handle.request_id, handle.transfer_id), None)
        if claim is None:
            claim = asyncio.ensure_future(self._timed_claim(handle))
            claim.add_done_callback(_retrieve)
        xfers: list[Any] = []  # filled on the agent thread, released there too
        try:
            entering = self._entering_post(posted)
            states = await self._thread.run(self._post_reads, handle, groups, xfers, entering)
            claimed_at, window = await claim
            deadline = claimed_at + window
            await self._wait(handle, xfers, states, deadline)
        except BaseException as exc:
            claim.cancel()  # a no-op once answered
            # Bytes may land in the destination blocks until the post returns
            # (a CPU READ copies inside it) and its READs are released (which
            # aborts an unfinished one); the caller frees the blocks once this
            # raises, so wait for both. The release queues behind the post.
            await self._thread.run(_release, xfers)
            if not release:  # none of our READs is left: the holder may end the window now
                self._thread.submit(self._send_done, *_claim_ids(handle))
            if not isinstance(exc, Exception):
                raise
            translated = self._translate(handle, exc)
            if translated is exc:
                raise
            raise translated from exc
        if time.monotonic() >= deadline:  # the holder may have freed them mid-READ
            self._thread.submit(_release, xfers)
            raise UnknownRequest(handle.request_id, handle.peer)
        return xfers

    def _entering_post(self, posted: asyncio.Future[None] | None) -> Callable[[], None]:
        """An agent-thread callback that settles `posted` on the loop."""
        if posted is None:
            return _nothing
        loop = asyncio.get_running_loop()

        def entering() -> None:
            loop.call_soon_threadsafe(_settle, posted)

        return entering

    def _check_layout(self, handle: TransferHandle, dest: LayoutSignature) -> LayoutSignature:
        """The holder's signature, checked against `dest` (cheap: it runs
        before the claim); `LayoutMismatch` unless both sides hold shards of
        one model and layout, or the same heads of one layout."""
        rid = handle.request_id
        if handle.agent_name is None or handle.agent_metadata is None:
            raise LayoutMismatch(rid, ["agent_name"], "handle has no NIXL agent")
        source = parse_signature(rid, handle.signature)
        check_shards(rid, source, dest)
        if same_heads(source, dest):
            # A replicated head may sit on a rank of another position.
            check_signature(rid, handle.signature, dest.to_dict(), ignore=("tp_size", "tp_rank"))
        return source

    def _plan(
        self,
        handle: TransferHandle,
        source: LayoutSignature,
        dest_regions: RequestRegions,
        dest: LayoutSignature,
    ) -> PairGroups:
        """The READs of this pull, grouped by descriptor table; `LayoutMismatch`
        unless the handle's cache fits `dest_regions` byte for byte.

        Ranks that hold the same heads read whole descriptors (a V2 block, a
        slot); ranks of different tensor parallelism read one descriptor per
        run of a head slice (`transfer.head_slices`), K and V of each block.
        """
        rid = handle.request_id
        if not same_heads(source, dest):
            pairs = plan_head_slices(rid, source, handle.regions, dest, dest_regions)
            check_bounds(rid, [p.dest_span() for p in pairs], self._sizes)
            return group_slice_pairs(pairs)
        src_desc, dst_desc = handle.regions.descriptors, dest_regions.descriptors
        if [r.length for r in src_desc] != [r.length for r in dst_desc]:
            raise LayoutMismatch(
                rid,
                ["descriptors"],
                f"the source has {len(src_desc)} descriptors, this side {len(dst_desc)}; "
                f"allocate as many blocks (and a Mamba slot) as the source holds",
            )
        check_bounds(rid, dst_desc, self._sizes)
        return group_pairs(src_desc, dst_desc)

    def _post_reads(
        self,
        handle: TransferHandle,
        groups: PairGroups,
        xfers: list[Any],
        entering: Callable[[], None],
    ) -> list[str]:
        """Agent thread: one READ per (local, remote) table pair; returns their
        states. `entering` runs just before the first post, which releases
        the GIL while it copies."""
        remote = self._remote_tables(handle)
        assert self._local is not None
        entering()
        states = []
        for (lkey, rkey), (lidx, ridx) in groups.items():
            xfer = self._agent.make_prepped_xfer(
                "READ", self._local.handle(lkey), lidx, remote.handle(rkey), ridx
            )
            xfers.append(xfer)
            state = self._agent.transfer(xfer)
            if state == "ERR":
                raise PeerGone(handle.request_id, handle.peer, "NIXL refused to post the READ")
            states.append(state)
        return states

    async def _claim(self, handle: TransferHandle) -> float:
        """Ask the holder to pin the request for our READs; the window it grants.

        Raises `UnknownRequest` when the holder answers that the lease is over.
        """
        key = (handle.request_id, handle.transfer_id)
        answer: asyncio.Future[float | None] = asyncio.get_running_loop().create_future()
        self._claims[key] = answer
        try:
            await self._thread.run(self._send_claim, handle)
            self._ensure_poller()  # the grant comes within a poll interval or two
            window = await answer
        finally:
            del self._claims[key]
        if window is None:
            raise UnknownRequest(handle.request_id, handle.peer)
        return window

    async def _wait(
        self, handle: TransferHandle, xfers: list[Any], states: list[str], deadline: float
    ) -> None:
        """Poll until every READ is done (on CPU loopback they finish inside the post);
        past `deadline` the holder may free the blocks, so stop with `UnknownRequest`."""
        start = time.monotonic()
        pending = [x for x, s in zip(xfers, states, strict=True) if s != "DONE"]
        while pending:
            if time.monotonic() >= deadline:
                raise UnknownRequest(handle.request_id, handle.peer)
            await asyncio.sleep(min(_MAX_POLL_GAP_S, (time.monotonic() - start) * _POLL_FRACTION))
            states = await self._thread.run(self._states, pending)
            if "ERR" in states:
                raise PeerGone(handle.request_id, handle.peer, "a NIXL READ failed")
            pending = [x for x, s in zip(pending, states, strict=True) if s != "DONE"]

    def _states(self, xfers: list[Any]) -> list[str]:
        return [self._agent.check_xfer_state(x) for x in xfers]

    def _translate(self, handle: TransferHandle, exc: Exception) -> Exception:
        """NIXL binding errors as transfer errors; a lost peer is forgotten."""
        name = type(exc).__name__
        if isinstance(exc, PeerGone) or name in _PEER_ERRORS:
            self._thread.submit(self._forget, handle.agent_name)  # reloaded on the next pull
        if name in _PEER_ERRORS:
            return PeerGone(handle.request_id, handle.peer, f"NIXL: {name}")
        if name.startswith("nixl"):
            return TransferError(f"NIXL failed on request {handle.request_id!r}: {name} {exc}")
        return exc

    def _notify_abort(self, handle: TransferHandle) -> None:
        if handle.agent_name is None:
            return
        message = b" ".join([_RELEASE, handle.request_id.encode(), handle.transfer_id.encode()])
        self._thread.submit(self._send_abort, handle.agent_name, message)

    # ------------------------------------------------------- agent thread only

    def _start_agent(self) -> None:
        self._agent = create_agent(self.name, self._progress_delay_us)
        for tensor in self._tensors.values():
            self._registered.append(self._agent.register_memory([tensor]))
        self._metadata = self._agent.get_agent_metadata()
        self._local = PreparedTables(self._buffers, self._prepare(_LOCAL_AGENT))

    def _close_agent(self) -> None:
        for tables in [self._local, *self._remote.values()]:
            if tables is not None:
                tables.release()
        for peer in list(self._remote):
            self._forget(peer)
        for puller in self._claimants:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(puller)
        self._claimants.clear()
        for reg in self._registered:
            self._agent.deregister_memory(reg)
        self._registered.clear()
        self._agent = None

    def _remote_tables(self, handle: TransferHandle) -> PreparedTables:
        peer, metadata = handle.agent_name, handle.agent_metadata
        assert peer is not None and metadata is not None  # checked by _pull
        tables = self._remote.get(peer)
        if tables is not None and self._remote_metadata.get(peer) != metadata:
            # The same agent name with new metadata: the holder was restarted.
            self._forget(peer)
            tables = None
        if tables is None:
            try:
                self._agent.add_remote_agent(metadata)
            except Exception as exc:
                raise PeerGone(handle.request_id, handle.peer, f"bad metadata: {exc}") from exc
            tables = PreparedTables(handle.buffers, self._prepare(peer))
            self._remote[peer] = tables
            self._remote_metadata[peer] = metadata
        return tables

    def _forget(self, peer: str) -> None:
        """Drop a peer's prepared lists and metadata (it died or we are closing)."""
        tables = self._remote.pop(peer, None)
        self._remote_metadata.pop(peer, None)
        if tables is not None:
            with contextlib.suppress(Exception):
                tables.release()
        with contextlib.suppress(Exception):
            self._agent.remove_remote_agent(peer)

    def _prepare(self, agent_name: str) -> Callable[[np.ndarray], object]:
        def prepare(entries: np.ndarray) -> object:
            return self._agent.prep_xfer_dlist(agent_name, entries, self._mem_type)

        return prepare

    def _finish(
        self, xfers: list[Any], handle: TransferHandle, dest: LayoutSignature, release: bool
    ) -> None:
        """Release the finished READs, then tell the holder: this puller rank is
        done with the request (it unpins it once every rank of the puller is),
        or without `release`, only that these READs of offered blocks are over."""
        _release(xfers)
        if not release:
            self._send_done(*_claim_ids(handle))
            return
        ids = [handle.request_id.encode(), handle.transfer_id.encode()]
        rank = f"{dest.tp_rank} {dest.tp_size}".encode()
        self._agent.send_notif(handle.agent_name, b" ".join([_RELEASE, *ids, rank]))

    def _send_done(self, holder: str, rid: str, tid: str) -> None:
        """Tell a holder our READs of its offered blocks are over, so it ends
        that claim's window (agent thread; a no-op for a leased request)."""
        self._agent.send_notif(holder, b" ".join([_DONE, rid.encode(), tid.encode()]))

    def _send_claim(self, handle: TransferHandle) -> None:
        """Claim a request; our metadata lets the holder answer."""
        self._remote_tables(handle)  # loads the holder, whom notifications need
        ids = [handle.request_id.encode(), handle.transfer_id.encode()]
        self._agent.send_notif(handle.agent_name, b" ".join([_CLAIM, *ids, self._metadata]))

    def _send_answer(self, puller: str, metadata: bytes, answer: bytes) -> None:
        """Answer a claim, loading the puller first (again, if it restarted)."""
        try:
            if puller not in self._remote and self._claimants.get(puller) != metadata:
                if puller in self._claimants:
                    self._agent.remove_remote_agent(puller)
                self._agent.add_remote_agent(metadata)
                self._claimants[puller] = metadata
            self._agent.send_notif(puller, answer)
        except Exception as exc:  # the puller died; its pull ends by timeout
            self._claimants.pop(puller, None)
            logger.warning("cannot answer the claim of %s: %s", puller, exc)

    def _send_abort(self, peer: str, message: bytes) -> None:
        """Best effort, to a peer this agent has loaded; others never got our READs."""
        if peer in self._remote:
            with contextlib.suppress(Exception):
                self._agent.send_notif(peer, message)


def _release(xfers: list[Any]) -> None:
    """Agent thread: release transfer handles; an unfinished READ is aborted."""
    for xfer in xfers:
        with contextlib.suppress(Exception):
            xfer.release()


async def _wait_all(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Return once every task is done, without cancelling any; a cancel of
    the caller meanwhile is raised only then."""
    interrupted: asyncio.CancelledError | None = None
    while not all(task.done() for task in tasks):
        try:
            await asyncio.wait(tasks)
        except asyncio.CancelledError as exc:
            interrupted = exc
    if interrupted is not None:
        raise interrupted


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _settle_after(future: asyncio.Future[None], _: asyncio.Future[Any]) -> None:
    """A done callback: settle `future` once the task it was passed to ended."""
    _settle(future)


def _nothing() -> None:
    """An agent-thread job that only marks its place in the queue."""


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a claim's outcome seen, so a failed one given up on logs nothing."""
    if not task.cancelled():
        task.exception()


def _buffer_info(tensor: torch.Tensor) -> BufferInfo:
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError("NIXL buffers must be flat contiguous uint8 tensors")
    device = tensor.get_device()
    return BufferInfo(tensor.data_ptr(), tensor.numel(), max(device, 0))


def _mem_type(tensors: Mapping[str, torch.Tensor]) -> str:
    kinds = {t.device.type for t in tensors.values()}
    if len(kinds) > 1:
        raise ValueError(f"NIXL pool buffers must all be on one device type, got {kinds}")
    return "VRAM" if kinds == {"cuda"} else "DRAM"


def _claim_ids(handle: TransferHandle) -> tuple[str, str, str]:
    """(holder agent, request id, transfer id) of a claim on `handle`."""
    assert handle.agent_name is not None  # checked before any claim
    return handle.agent_name, handle.request_id, handle.transfer_id
