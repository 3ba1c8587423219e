"""The transceiver interface: publish a request's cache on one worker, pull it on another.

Context side (holder)::

    handle = xcvr.publish(request_id, regions, signature, lease_s, on_release)
    # ... hand `handle` to the router (it is small and msgpack-serializable)

Generation side (puller)::

    await xcvr.pull(handle, dest_regions, dest_signature, timeout_s)

Chunk-pipelined transfer (see `transfer.offers`): while a prompt still
prefills, the holder offers the blocks of each finished chunk
(`offer` -> a handle over just those blocks), the puller reads them with
`pull(..., release=False)`, and the final pull after `publish` moves the
rest and releases. `publish` keeps the offers' transfer id.

The holder keeps the request's blocks (and Mamba slot) pinned until the puller
releases them after a complete pull, the holder aborts, or the lease expires;
each ends in exactly one `on_release(request_id)` call, so the worker frees
once. The puller frees its own destination blocks when `pull` raises; a pull
that fails, times out or is cancelled also tells the holder (best effort) to
release at once rather than at lease expiry.
Signatures are compared before any byte moves.
"""

from __future__ import annotations

import asyncio
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, ClassVar

from kvcache.layout import LayoutSignature, RequestRegions
from runtime.cancellation import current_task_cancelling
from transfer.errors import LayoutMismatch, TransferAborted, TransferTimeout, UnknownRequest
from transfer.handle import TransferHandle
from transfer.leases import LeaseTable
from transfer.offers import Offer
from transfer.region_arrays import segment_arrays


class Transceiver(ABC):
    """Moves published request caches between workers; see the module docstring.

    Must be used from one asyncio event loop (the worker actor's). Subclasses
    implement `start`, `close`, `publish`, `_pull` and `_notify_abort`.
    """

    kind: ClassVar[str]

    def __init__(self) -> None:
        self._leases = LeaseTable()
        self._offers: dict[str, Offer] = {}
        self._pulls: dict[str, asyncio.Task[None]] = {}

    @property
    def num_pinned(self) -> int:
        """Requests published here and not yet released."""
        return len(self._leases)

    def is_pinned(self, request_id: str) -> bool:
        """Whether `request_id` is published here and not yet released."""
        return request_id in self._leases

    @abstractmethod
    async def start(self) -> None:
        """Bind/register resources; call once before `publish` or `pull`."""

    @abstractmethod
    async def close(self) -> None:
        """Release every pinned request, stop serving, free transport resources."""

    @abstractmethod
    def publish(
        self,
        request_id: str,
        regions: RequestRegions,
        signature: LayoutSignature,
        lease_s: float,
        on_release: Callable[[str], None],
    ) -> TransferHandle:
        """Pin `regions` for pulling; `on_release(request_id)` runs exactly once."""

    def offer(
        self, request_id: str, regions: RequestRegions, signature: LayoutSignature
    ) -> TransferHandle:
        """Make `regions` (finished blocks of a prompt still prefilling) readable
        by `pull(..., release=False)` ahead of `publish`; returns a handle over
        exactly them. Offers of one request accumulate under one transfer id,
        which `publish` keeps. The caller keeps the blocks allocated (they are
        not pinned by this) until `publish`'s release or `withdraw`'s `on_quiet`.
        """
        offer = self._offers.get(request_id)
        if offer is None:
            offer = self._offers[request_id] = Offer(request_id, self.new_transfer_id())
        offer.extend(segment_arrays(regions))
        return self._handle(request_id, offer.transfer_id, regions, signature)

    def withdraw(self, request_id: str, on_quiet: Callable[[], None]) -> None:
        """End the offers of a request that will not be published (aborted,
        failed, finished at its first token, preempted); `on_quiet()` runs once
        no read of them is in flight (at once if there is none or no offer)."""
        offer = self._offers.pop(request_id, None)
        if offer is None:
            on_quiet()
            return
        self._stop_reads(request_id)
        offer.withdraw(on_quiet)

    @abstractmethod
    def _stop_reads(self, request_id: str) -> None:
        """Cut reads of `request_id` this side serves, where the transport can."""

    def _transfer_id_for(self, request_id: str) -> str:
        """The id `publish` gives a request: its offers' id, or a new one."""
        offer = self._offers.pop(request_id, None)
        return offer.transfer_id if offer is not None else self.new_transfer_id()

    @abstractmethod
    def _handle(
        self,
        request_id: str,
        transfer_id: str,
        regions: RequestRegions,
        signature: LayoutSignature,
    ) -> TransferHandle:
        """A handle that addresses `regions` of this holder."""

    def release(self, request_id: str) -> bool:
        """Unpin a published request locally; idempotent. True if it was pinned."""
        return self._leases.release(request_id)

    def abort(self, request_id: str) -> None:
        """Give up on `request_id` on this worker, on either side.

        Holder: unpin now (`on_release` runs). Puller: cancel an in-flight pull
        (it raises `TransferAborted`; the caller frees its blocks) and tell the
        holder to free its side. Idempotent.
        """
        self._leases.release(request_id)
        task = self._pulls.get(request_id)
        if task is not None and not task.done():
            task.cancel()

    def claim_ahead(self, handles: Sequence[TransferHandle]) -> None:
        """The caller will `pull_ranks(handles, ...)` once its destination is
        allocated: a transport whose pull opens with a round trip to the holder
        may start that round trip now. The caller ends what this starts with
        that `pull_ranks` or with `abort(request_id)`. Here: nothing to start."""
        return None

    async def pull(
        self,
        handle: TransferHandle,
        dest_regions: RequestRegions,
        dest_signature: LayoutSignature,
        timeout_s: float,
        *,
        release: bool = True,
    ) -> None:
        """Copy the handle's cache into `dest_regions`; on success the holder is released.

        With `release=False` (a pull of offered blocks, or of part of a
        published cache) the holder keeps the request: a later pull releases.

        Raises `LayoutMismatch` (before any byte moves), `TransferTimeout` after
        `timeout_s`, `PeerGone` if the holder died, `TransferAborted` if
        `abort(request_id)` ran meanwhile, `UnknownRequest` if the holder no
        longer has it. On any error the destination contents are undefined.
        """
        self._check_kind(handle)
        pull = self._pull(handle, dest_regions, dest_signature, release)
        await self._guard([handle], pull, timeout_s)

    def _check_kind(self, handle: TransferHandle) -> None:
        if handle.kind != self.kind:
            raise LayoutMismatch(
                handle.request_id,
                ["cache_transceiver.backend"],
                f"the holder published with {handle.kind!r}, this worker pulls with "
                f"{self.kind!r}; use one backend on every instance",
            )

    async def _guard(
        self,
        handles: Sequence[TransferHandle],
        pull: Coroutine[Any, Any, None],
        timeout_s: float,
    ) -> None:
        """Run `pull` (of one request from the holders of `handles`) as a task
        `abort(request_id)` can cancel, within `timeout_s`; on failure tell the
        holders to release now. Errors as in `pull`."""
        handle = handles[-1]
        rid = handle.request_id
        # A task of its own, so `abort` can cancel the pull without cancelling
        # the caller; awaiting it directly keeps a small pull to a few loop turns.
        task = asyncio.ensure_future(pull)
        self._pulls[rid] = task
        try:
            async with asyncio.timeout(timeout_s):
                await task
        except TimeoutError:
            # The holder may only be stalled: have it free now, not at lease end.
            self._notify_aborts(handles)
            raise TransferTimeout(rid, handle.peer, timeout_s) from None
        except asyncio.CancelledError:
            if task.cancelled() and not current_task_cancelling():
                self._notify_aborts(handles)
                raise TransferAborted(rid, "aborted on the generation side") from None
            task.cancel()
            self._notify_aborts(handles)  # our caller went away: free the holder too
            raise
        except UnknownRequest as exc:
            # That holder already freed it; any other rank still holds it.
            self._notify_aborts([h for h in handles if h.peer != exc.peer])
            raise
        except Exception:
            # A failed pull (layout mismatch, broken connection, NIXL error)
            # releases the holder promptly instead of at lease expiry.
            self._notify_aborts(handles)
            raise
        finally:
            if self._pulls.get(rid) is task:
                del self._pulls[rid]

    def _notify_aborts(self, handles: Sequence[TransferHandle]) -> None:
        for handle in handles:
            self._notify_abort(handle)

    async def pull_ranks(
        self,
        handles: Sequence[TransferHandle],
        dest_regions: RequestRegions,
        dest_signature: LayoutSignature,
        timeout_s: float,
    ) -> None:
        """Pull one request from every rank of a tensor-parallel holder, one
        handle per rank, in order; rank 0's handle comes last.

        Each puller rank reads the heads it needs from each holder rank
        (possibly none: the pull then only releases). Rank 0 of the holder
        frees the blocks once it is released, which it is after every puller
        rank pulled it, that is after all their other pulls. If a pull fails,
        the holders not yet pulled are told to release now; errors as in `pull`.
        """
        for i, handle in enumerate(handles):
            try:
                await self.pull(handle, dest_regions, dest_signature, timeout_s)
            except BaseException:
                for later in handles[i + 1 :]:
                    self._notify_abort(later)
                raise

    @abstractmethod
    async def _pull(
        self,
        handle: TransferHandle,
        dest_regions: RequestRegions,
        dest: LayoutSignature,
        release: bool,
    ) -> None:
        """Move the bytes and, with `release`, release the holder; errors as in `pull`."""

    @abstractmethod
    def _notify_abort(self, handle: TransferHandle) -> None:
        """Best effort: tell the holder the pull was aborted so it frees early."""

    @staticmethod
    def new_transfer_id() -> str:
        return uuid.uuid4().hex
