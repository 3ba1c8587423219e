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

`NixlTransceiver` is the `Transceiver` over both sides and the one poller of
the agent's notifications; the rest lives in modules of their own:

    transfer.nixl.endpoint       the agent, its registered pool, the peers it loaded
    transfer.nixl.notifications  the messages above, and why a claim makes READs safe
    transfer.nixl.holder         answering claims, claim windows on offered blocks
    transfer.nixl.puller         claiming (ahead), posting READs, waiting, releasing
    transfer.nixl.read_plan      the layout check and the READs a pull makes

The generation worker claims ahead (`claim_ahead`), as soon as the request
reaches it: the grant's round trip overlaps the wait for destination blocks,
and a holder polls every 0.25 ms while a published request awaits its claim.

Every call on the agent runs on the endpoint's own `AgentThread`s, never on
the event loop: over UCX on CPU a READ copies inside its post, and a pull in
flight must not stall the running batch. Lease and bookkeeping state stays on
the loop; the agent stays on its thread, which also polls notifications, and
the post threads (`transfer.nixl.endpoint`) only post READs and release them.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

import torch

from kvcache.layout import LayoutSignature, RequestRegions
from transfer.base import Transceiver
from transfer.handle import TransferHandle
from transfer.nixl.agent import (
    DEFAULT_PROGRESS_DELAY_US,
    PollPlan,
    create_agent,
    nixl_available,
)
from transfer.nixl.endpoint import NixlEndpoint
from transfer.nixl.holder import NixlHolder
from transfer.nixl.notifications import CLAIM, DONE, EXPIRED, GRANT, RELEASE
from transfer.nixl.puller import NixlPuller
from transfer.plan import check_bounds
from transfer.region_arrays import descriptor_arrays

__all__ = ["DEFAULT_PROGRESS_DELAY_US", "NixlTransceiver", "create_agent", "nixl_available"]

logger = logging.getLogger(__name__)

# Notification polls of an agent with nothing pinned or claimed.
_IDLE_POLL_INTERVAL_S = 0.05
# ... and of a holder with a published request not yet claimed: the first
# token has reached the caller, who now waits on this round trip, and a claim
# is due within milliseconds. The puller's READs are done long before the
# grant comes for a small request, so this poll sets its pull's time: polling
# every 0.25 ms instead of every 1 ms about halved a one-block pull's p50 in
# `python -m benchmarks.transfer.throughput` (docs/performance.md). The holder
# polls this fast only until the claim comes (in serving the generation worker
# claims ahead, as soon as the request reaches it): four cheap polls on the
# agent thread for every millisecond the claim takes.
_CLAIM_POLL_INTERVAL_S = 0.00025
# ... but only this long after the latest publish: a claim that has not come
# by then is late anyway (its puller is queued, paused or dead), and polling
# every 0.25 ms for the rest of a 60 s lease kept a holder whose only
# published request was never claimed measurably busy (docs/performance.md).
_CLAIM_DUE_WINDOW_S = 0.05
# ... and of a puller waiting for a grant: the holder answers within its own
# poll, so the grant is due within about a millisecond, and the READs wait on
# it (a large READ takes milliseconds on CPU). Such a wait is short and rare enough
# that polling it finely costs little CPU.
_GRANT_POLL_INTERVAL_S = 0.0002


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
        self.name = name or f"disagg-{uuid.uuid4().hex[:12]}"
        self._poll_interval_s = poll_interval_s
        self._claim_due_until = 0.0  # monotonic: a claim is due until then (the latest publish)
        self._endpoint = NixlEndpoint(buffers, self.name, progress_delay_us)
        self._thread = self._endpoint.thread
        self._holder = NixlHolder(self._endpoint, self._leases, self._offers, claim_window_s)
        self._puller = NixlPuller(self._endpoint, self.kind, self._ensure_poller)
        self._loop: asyncio.AbstractEventLoop | None = None
        # Re-paces the agent thread's polls now and then (leases expire quietly).
        self._pacer: asyncio.TimerHandle | None = None
        self._closed = False

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._thread.run(self._endpoint.start)

    async def close(self) -> None:
        self._closed = True
        self._thread.poll_with(None)  # before the agent closes, on the same thread
        if self._pacer is not None:
            self._pacer.cancel()
        tasks = list(self._pulls.values())
        for task in tasks:
            task.cancel()
        # A cancelled pull returns once its READs are released, before the agent closes.
        await asyncio.gather(*tasks, return_exceptions=True)
        self._leases.release_all()
        self._holder.close_all_windows()  # no READ reaches a closed agent
        if self._endpoint.agent is not None:
            await self._thread.run(self._endpoint.close)
        for thread in self._endpoint.post_threads:
            thread.shutdown()

    # ----------------------------------------------------------------- holder

    def publish(
        self,
        request_id: str,
        regions: RequestRegions,
        signature: LayoutSignature,
        lease_s: float,
        on_release: Callable[[str], None],
    ) -> TransferHandle:
        if self._endpoint.agent is None:
            raise RuntimeError("NixlTransceiver.start() has not run")
        check_bounds(request_id, descriptor_arrays(regions), self._endpoint.sizes)
        tid = self._transfer_id_for(request_id)
        self._leases.add(request_id, tid, lease_s, on_release)
        self._claim_due_until = time.monotonic() + _CLAIM_DUE_WINDOW_S
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
            agent_metadata=self._endpoint.metadata,
            buffers=dict(self._endpoint.buffers),
        )

    def _stop_reads(self, request_id: str) -> None:
        """READs are one-sided: an offer's claim windows end them (or their
        "done" notifications, sooner)."""

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
        posted once planned, the ranks' READs side by side on the
        endpoint's post threads. The holders are released in order, rank 0
        last, once every READ is done: rank 0 frees the blocks of all ranks. A
        failure stops the other ranks' READs and waits for them before it
        raises."""
        if not handles:
            return
        for handle in handles:
            self._check_kind(handle)
            self._puller.end_claim_ahead(handle.request_id)  # this pull ends those claims
        pull = self._puller.pull_all(handles, dest_regions, dest_signature)
        try:
            await self._guard(handles, pull, timeout_s)
        finally:
            await self._puller.drop_claims(handles)

    def claim_ahead(self, handles: Sequence[TransferHandle]) -> None:
        """Claim now: the grant's round trip overlaps the wait for the destination."""
        self._puller.claim_ahead(handles)

    def abort(self, request_id: str) -> None:
        """`Transceiver.abort`; claims sent ahead of a pull that never began
        are dropped and their holders told to free."""
        super().abort(request_id)
        self._puller.abort_claims_ahead(request_id)

    async def _pull(
        self,
        handle: TransferHandle,
        dest_regions: RequestRegions,
        dest: LayoutSignature,
        release: bool,
    ) -> None:
        await self._puller.pull(handle, dest_regions, dest, release)

    def _notify_abort(self, handle: TransferHandle) -> None:
        self._puller.notify_abort(handle)

    # ---------------------------------------------------------- notifications

    def _ensure_poller(self) -> None:
        """Poll now, and at the pace what this side awaits sets: a publish, an
        offer or a claim expects notifications soon, and an idle pace is slow.

        The agent thread polls (`AgentThread.poll_with`): slowly while nothing
        is pinned or claimed, since a late claim of an expired lease must still
        get its answer. The loop re-paces it as notifications come and every
        `_IDLE_POLL_INTERVAL_S`.
        """
        if self._closed:
            return
        if self._pacer is None:
            self._thread.poll_with(self._poll)
            self._pacer = asyncio.get_running_loop().call_later(_IDLE_POLL_INTERVAL_S, self._repace)
        self._pace(now=True)

    def _pace(self, now: bool = False) -> None:
        busy = len(self._leases) or self._offers
        slow = self._poll_interval_s if busy else _IDLE_POLL_INTERVAL_S
        if self._puller.awaiting_grant:
            plan = PollPlan(min(_GRANT_POLL_INTERVAL_S, self._poll_interval_s))
        elif self._leases.num_unclaimed and time.monotonic() < self._claim_due_until:
            fast = min(_CLAIM_POLL_INTERVAL_S, self._poll_interval_s)
            plan = PollPlan(fast, until=self._claim_due_until, then_s=slow)
        else:
            plan = PollPlan(slow)
        self._thread.pace(plan, now)

    def _repace(self) -> None:
        if self._closed:
            return
        self._pace()
        self._pacer = asyncio.get_running_loop().call_later(_IDLE_POLL_INTERVAL_S, self._repace)

    def _poll(self) -> None:
        """Agent thread: hand new notifications, if any, to the loop."""
        notifications = self._endpoint.agent.get_new_notifs()
        if notifications:
            assert self._loop is not None  # set by start, before any poll
            self._loop.call_soon_threadsafe(self._apply_notifications, notifications)

    def _apply_notifications(self, notifications: Mapping[str, Sequence[bytes]]) -> None:
        if self._closed:
            return  # every lease and window is released already
        for sender, messages in notifications.items():
            for message in messages:
                self._apply_notification(sender, message)
        self._pace()

    def _apply_notification(self, sender: str, message: bytes) -> None:
        kind, _, rest = message.partition(b" ")
        parts = rest.split(b" ", 2)
        if kind == RELEASE and len(parts) == 2:  # an aborted pull: release now
            self._leases.release(parts[0].decode(), parts[1].decode())
        elif kind == DONE and len(parts) == 2:
            self._holder.close_window(parts[0].decode(), parts[1].decode())
        elif kind == RELEASE and len(parts) == 3:
            rank, of = (int(n) for n in parts[2].split())
            self._leases.release_by(parts[0].decode(), parts[1].decode(), rank, of)
        elif kind == CLAIM and len(parts) == 3:
            self._holder.answer_claim(sender, parts[0].decode(), parts[1].decode(), parts[2])
        elif kind in (GRANT, EXPIRED) and len(parts) >= 2:
            self._puller.on_answer(sender, kind, parts)
        else:
            logger.warning("ignoring unexpected NIXL notification %r", message[:64])
