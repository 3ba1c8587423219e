"""The puller side of NIXL: claiming a request and READing it from its holders.

A claim goes out as soon as a pull begins, or earlier with `claim_ahead`,
and the READs go out without waiting for its grant (why that is sound:
`transfer.nixl.notifications`); which READs a pull makes is
`transfer.nixl.read_plan`. A pull from several holder ranks (`pull_all`,
the body of `NixlTransceiver.pull_ranks`) claims them all at once and
overlaps their READs: each rank's are posted once planned, on the next of
the endpoint's post threads (so ranks copy side by side), the next rank is
planned while they copy, and the holders are released in order, rank 0 last,
once every READ is done.

A pull that fails, times out or is aborted raises only once its READs are
over or released, since its caller frees the destination blocks right after.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvcache.layout import LayoutSignature, RequestRegions
from transfer.errors import PeerGone, TransferError, UnknownRequest
from transfer.handle import TransferHandle
from transfer.nixl.agent import AgentThread
from transfer.nixl.descriptors import PairGroups
from transfer.nixl.endpoint import NixlEndpoint
from transfer.nixl.notifications import CLAIM, DONE, GRANT, RELEASE
from transfer.nixl.read_plan import check_layout, plan_reads

# Completion polls of a READ still in flight (RDMA, GPU) sleep a small fraction
# of its age, so a short READ is seen done within microseconds and a long one
# costs at most one poll per `_MAX_POLL_GAP_S`.
_POLL_FRACTION = 0.05
_MAX_POLL_GAP_S = 0.0005
# Binding exceptions (no common base class) that mean the holder is unreachable.
_PEER_ERRORS = frozenset({"nixlRemoteDisconnectError", "nixlBackendError"})


class NixlPuller:
    """Claims and READs of one transceiver's pulls, on the event loop; the
    agent is reached only through jobs on the endpoint's threads.

    kind: the handle kind this side pulls ("nixl").
    wake_poller: polls notifications now and paces the polls for the grant,
        which comes within a poll interval or two.
    """

    def __init__(self, endpoint: NixlEndpoint, kind: str, wake_poller: Callable[[], None]) -> None:
        self._endpoint = endpoint
        self._thread = endpoint.thread
        self._kind = kind
        self._wake_poller = wake_poller
        # Claims sent and not yet answered, by (request id, transfer id).
        self._claims: dict[tuple[str, str], asyncio.Future[float | None]] = {}
        # Claims `pull_ranks` sent ahead, (sent at, granted window), by (rid, tid).
        self._early_claims: dict[tuple[str, str], asyncio.Task[tuple[float, float]]] = {}
        # Handles of `claim_ahead` whose `pull_ranks` has not begun, by request id.
        self._claimed_ahead: dict[str, list[TransferHandle]] = {}

    @property
    def awaiting_grant(self) -> bool:
        """Whether a claim of ours awaits its holder's answer (an answered one
        is forgotten only once its pull resumes)."""
        return any(not answer.done() for answer in self._claims.values())

    def on_answer(self, holder: str, kind: bytes, parts: Sequence[bytes]) -> None:
        """A holder's "grant <rid> <tid> <W>" or "expired <rid> <tid>"."""
        rid, tid = parts[0].decode(), parts[1].decode()
        claim = self._claims.get((rid, tid))
        if claim is not None and not claim.done():
            claim.set_result(float(parts[2]) if kind == GRANT else None)
        elif kind == GRANT:  # the pull was cancelled meanwhile: end the window
            self._thread.submit(self._send_done, holder, rid, tid)

    # ------------------------------------------------------------------ claims

    def claim_ahead(self, handles: Sequence[TransferHandle]) -> None:
        """Claim now: the grant's round trip overlaps the wait for the destination."""
        for handle in self._claim_each(handles):
            self._claimed_ahead.setdefault(handle.request_id, []).append(handle)

    def end_claim_ahead(self, request_id: str) -> None:
        """A pull of `request_id` begins: it ends the claims sent ahead for it."""
        self._claimed_ahead.pop(request_id, None)

    def abort_claims_ahead(self, request_id: str) -> None:
        """Drop claims sent ahead of a pull that never began, and tell their
        holders to free."""
        for handle in self._claimed_ahead.pop(request_id, []):
            early = self._early_claims.pop((handle.request_id, handle.transfer_id), None)
            if early is not None:
                early.cancel()
                self.notify_abort(handle)

    def _claim_each(self, handles: Sequence[TransferHandle]) -> list[TransferHandle]:
        """Send a claim for each NIXL handle not claimed yet; the handles claimed."""
        claimed = []
        for handle in handles:
            key = (handle.request_id, handle.transfer_id)
            if handle.kind != self._kind or handle.agent_name is None or key in self._early_claims:
                continue
            task = asyncio.ensure_future(self._timed_claim(handle))
            task.add_done_callback(_retrieve)  # a claim given up on may have failed
            self._early_claims[key] = task
            claimed.append(handle)
        return claimed

    async def _timed_claim(self, handle: TransferHandle) -> tuple[float, float]:
        """(when the claim left, the window granted); see `_claim`."""
        claimed_at = time.monotonic()
        return claimed_at, await self._claim(handle)

    async def _claim(self, handle: TransferHandle) -> float:
        """Ask the holder to pin the request for our READs; the window it grants.

        Raises `UnknownRequest` when the holder answers that the lease is over.
        """
        key = (handle.request_id, handle.transfer_id)
        answer: asyncio.Future[float | None] = asyncio.get_running_loop().create_future()
        self._claims[key] = answer
        try:
            await self._thread.run(self._send_claim, handle)
            self._wake_poller()  # the grant comes within a poll interval or two
            window = await answer
        finally:
            del self._claims[key]
        if window is None:
            raise UnknownRequest(handle.request_id, handle.peer)
        return window

    async def _send_claims(self, handles: Sequence[TransferHandle]) -> None:
        """Claim each handle not claimed yet, and return once the claims' sends
        are queued on the agent thread, which runs jobs in order: ahead of
        any READ posted after this returns."""
        if self._claim_each(handles):
            await asyncio.sleep(0)  # each claim task runs up to its queued send

    async def drop_claims(self, handles: Sequence[TransferHandle]) -> None:
        """Forget claims of `handles` no READ took (a pull failed before it):
        their holders are told to release by the pull's failure, so only the
        local futures are left."""
        for handle in handles:
            early = self._early_claims.pop((handle.request_id, handle.transfer_id), None)
            if early is not None:
                early.cancel()
                await asyncio.gather(early, return_exceptions=True)

    # ------------------------------------------------------------------- pulls

    async def pull(
        self,
        handle: TransferHandle,
        dest_regions: RequestRegions,
        dest: LayoutSignature,
        release: bool,
    ) -> None:
        """`Transceiver._pull`: one holder's READs, then (with `release`) its release."""
        source = check_layout(handle, dest)
        self.end_claim_ahead(handle.request_id)  # a plain `pull` after `claim_ahead`
        try:
            await self._send_claims([handle])  # its round trip overlaps the planning
            groups = plan_reads(handle, source, dest_regions, dest, self._endpoint.sizes)
            xfers = await self._read(handle, groups, release, self._thread)
        finally:
            await self.drop_claims([handle])
        # The holder learns in the background; the caller has its bytes now.
        self._thread.submit(self._finish, xfers, handle, dest, release)

    async def pull_all(
        self, handles: Sequence[TransferHandle], dest_regions: RequestRegions, dest: LayoutSignature
    ) -> None:
        """`pull_ranks`' body: every handle's READs, then every release."""
        sources = [check_layout(handle, dest) for handle in handles]
        await self._send_claims(handles)
        reads: list[asyncio.Task[list[Any]]] = []
        lanes = self._endpoint.post_threads
        try:
            for i, (handle, source) in enumerate(zip(handles, sources, strict=True)):
                groups = plan_reads(handle, source, dest_regions, dest, self._endpoint.sizes)
                posted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                lane = lanes[i % len(lanes)]  # ranks' READs copy side by side
                read = asyncio.ensure_future(self._read(handle, groups, True, lane, posted))
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

    async def _read(
        self,
        handle: TransferHandle,
        groups: PairGroups,
        release: bool,
        lane: AgentThread,
        posted: asyncio.Future[None] | None = None,
    ) -> list[Any]:
        """Post the READs of `groups` on `lane` (settling `posted` as it
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
        xfers: list[Any] = []  # filled on `lane`; released there if this fails, else by `_finish`
        try:
            entering = self._entering_post(posted)
            states = await lane.run(self._post_reads, handle, groups, xfers, entering)
            claimed_at, window = await claim
            deadline = claimed_at + window
            await self._wait(handle, xfers, states, deadline)
        except BaseException as exc:
            claim.cancel()  # a no-op once answered
            # Bytes may land in the destination blocks until the post returns
            # (a CPU READ copies inside it) and its READs are released (which
            # aborts an unfinished one); the caller frees the blocks once this
            # raises, so wait for both. The release queues behind the post.
            await lane.run(_release, xfers)
            if not release:  # none of our READs is left: the holder may end the window now
                self._thread.submit(self._send_done, *_claim_ids(handle))
            if not isinstance(exc, Exception):
                raise
            translated = self._translate(handle, exc)
            if translated is exc:
                raise
            raise translated from exc
        if time.monotonic() >= deadline:  # the holder may have freed them mid-READ
            lane.submit(_release, xfers)
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

    def _translate(self, handle: TransferHandle, exc: Exception) -> Exception:
        """NIXL binding errors as transfer errors; a lost peer is forgotten."""
        name = type(exc).__name__
        if isinstance(exc, PeerGone) or name in _PEER_ERRORS:
            self._thread.submit(self._endpoint.forget, handle.agent_name)  # reloaded next pull
        if name in _PEER_ERRORS:
            return PeerGone(handle.request_id, handle.peer, f"NIXL: {name}")
        if name.startswith("nixl"):
            return TransferError(f"NIXL failed on request {handle.request_id!r}: {name} {exc}")
        return exc

    def notify_abort(self, handle: TransferHandle) -> None:
        """`Transceiver._notify_abort`: best effort, in the background."""
        if handle.agent_name is None:
            return
        message = b" ".join([RELEASE, handle.request_id.encode(), handle.transfer_id.encode()])
        self._thread.submit(self._send_abort, handle.agent_name, message)

    # ------------------------------------------------------- agent thread only

    def _post_reads(
        self,
        handle: TransferHandle,
        groups: PairGroups,
        xfers: list[Any],
        entering: Callable[[], None],
    ) -> list[str]:
        """One READ per (local, remote) table pair; returns their states.
        `entering` runs just before the first post, which releases the GIL
        while it copies."""
        agent = self._endpoint.agent
        remote = self._endpoint.remote_tables(handle)
        local = self._endpoint.local
        assert local is not None
        entering()
        states = []
        for (lkey, rkey), (lidx, ridx) in groups.items():
            xfer = agent.make_prepped_xfer(
                "READ", local.handle(lkey), lidx, remote.handle(rkey), ridx
            )
            xfers.append(xfer)
            state = agent.transfer(xfer)
            if state == "ERR":
                raise PeerGone(handle.request_id, handle.peer, "NIXL refused to post the READ")
            states.append(state)
        return states

    def _states(self, xfers: list[Any]) -> list[str]:
        return [self._endpoint.agent.check_xfer_state(x) for x in xfers]

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
        self._endpoint.agent.send_notif(handle.agent_name, b" ".join([RELEASE, *ids, rank]))

    def _send_done(self, holder: str, rid: str, tid: str) -> None:
        """Tell a holder our READs of its offered blocks are over, so it ends
        that claim's window (a no-op for a leased request)."""
        self._endpoint.agent.send_notif(holder, b" ".join([DONE, rid.encode(), tid.encode()]))

    def _send_claim(self, handle: TransferHandle) -> None:
        """Claim a request; our metadata lets the holder answer."""
        self._endpoint.remote_tables(handle)  # loads the holder, whom notifications need
        ids = [handle.request_id.encode(), handle.transfer_id.encode()]
        metadata = self._endpoint.metadata
        self._endpoint.agent.send_notif(handle.agent_name, b" ".join([CLAIM, *ids, metadata]))

    def _send_abort(self, peer: str, message: bytes) -> None:
        """Best effort, to a peer this agent has loaded; others never got our READs."""
        if peer in self._endpoint.remote:
            with contextlib.suppress(Exception):
                self._endpoint.agent.send_notif(peer, message)


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


def _claim_ids(handle: TransferHandle) -> tuple[str, str, str]:
    """(holder agent, request id, transfer id) of a claim on `handle`."""
    assert handle.agent_name is not None  # checked before any claim
    return handle.agent_name, handle.request_id, handle.transfer_id
