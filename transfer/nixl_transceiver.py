"""The NIXL transceiver: one agent per worker, generation side READs, a notification releases.

    holder (context)                         puller (generation)
    register pool buffers once               register pool buffers once
    publish -> handle {agent name,           pull: signatures equal? else LayoutMismatch
        metadata, buffer addresses,                load holder metadata (once per peer)
        descriptors}        --- Ray --->           READ descriptor indices from tables
                                                   prepared once per (peer, buffer)
    poll notifications   <--- notif ---            "release <rid> <tid>" when all READs done
    -> on_release(rid)

NIXL moves raw memory by descriptor, so both sides must lay their cache out
identically (same manager, dtype, block size, heads, layers): the signature is
compared before any byte moves. V1 <-> V2 needs the Python transceiver.

READs are one-sided, so the holder cannot see them: a pull must start and
finish inside the lease (the puller checks the handle's expiry before and
after its READs), and a holder that aborts a request while a READ is in
flight cannot stop it; keep `cache_transceiver.lease_s` above `timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from kvcache.layout import LayoutSignature, RequestRegions
from transfer.base import BufferInfo, Transceiver, TransferHandle, check_signature
from transfer.errors import LayoutMismatch, PeerGone, TransferError, UnknownRequest
from transfer.nixl_descriptors import PreparedTables, group_pairs
from transfer.plan import check_bounds

logger = logging.getLogger(__name__)

_RELEASE = b"release"
_LOCAL_AGENT = "NIXL_INIT_AGENT"
# Binding exceptions (no common base class) that mean the holder is unreachable.
_BUSY_POLL_S = 0.05  # poll without sleeping for this long, then every 0.5 ms
_PEER_ERRORS = frozenset({"nixlRemoteDisconnectError", "nixlBackendError"})
# The UCX progress thread sleeps this long between polls. nixl_agent() uses 0,
# which spins one core per agent; an idle worker must not burn a core.
DEFAULT_PROGRESS_DELAY_US = 1000


def create_agent(name: str, progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US) -> Any:
    """A `nixl_agent` with a UCX backend whose progress thread polls every `progress_delay_us`.

    `nixl_agent()` hard-codes the progress-thread delay to 0, so the agent is
    built without backends, its core agent is replaced by one made from a
    config with the delay, and UCX is created on that one. The progress thread
    stays on: without it a READ from an idle peer never completes.
    """
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t, nixlBind

    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    config = nixlBind.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.syncMode = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE.value
    config.pthrDelay = progress_delay_us
    config.lthrDelay = 100000
    agent.agent = nixlBind.nixlAgent(name, config)
    agent.create_backend("UCX", {})
    return agent


def nixl_available() -> bool:
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return False
    return True


class NixlTransceiver(Transceiver):
    """NIXL transceiver over the worker's registered buffers (CPU or CUDA).

    buffers: name -> flat uint8 tensor (`CacheTensors.buffers()`), registered
        once as DRAM or VRAM.
    name: the agent name, unique in the cluster (a random one by default).
    poll_interval_s: how often the holder polls release notifications while
        it has pinned requests (it does not poll when idle).
    """

    kind = "nixl"

    def __init__(
        self,
        buffers: Mapping[str, torch.Tensor],
        name: str | None = None,
        progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
        poll_interval_s: float = 0.005,
    ) -> None:
        super().__init__()
        self._tensors = dict(buffers)
        self.name = name or f"disagg-{uuid.uuid4().hex[:12]}"
        self._progress_delay_us = progress_delay_us
        self._poll_interval_s = poll_interval_s
        self._agent: Any = None
        self._registered: list[Any] = []
        self._metadata = b""
        self._buffers = {n: _buffer_info(t) for n, t in self._tensors.items()}
        self._sizes = {n: b.num_bytes for n, b in self._buffers.items()}
        self._mem_type = _mem_type(self._tensors)
        self._local: PreparedTables | None = None
        self._remote: dict[str, PreparedTables] = {}
        self._remote_metadata: dict[str, bytes] = {}
        self._poller: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._agent = create_agent(self.name, self._progress_delay_us)
        for tensor in self._tensors.values():
            self._registered.append(self._agent.register_memory([tensor]))
        self._metadata = self._agent.get_agent_metadata()
        self._local = PreparedTables(self._buffers, self._prepare(_LOCAL_AGENT))

    async def close(self) -> None:
        for task in [self._poller, *self._pulls.values()]:
            if task is not None:
                task.cancel()
        if self._poller is not None:
            await asyncio.gather(self._poller, return_exceptions=True)
        self._leases.release_all()
        if self._agent is None:
            return
        for tables in [self._local, *self._remote.values()]:
            if tables is not None:
                tables.release()
        for peer in list(self._remote):
            self._forget(peer)
        for reg in self._registered:
            self._agent.deregister_memory(reg)
        self._registered.clear()

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
        tid = self.new_transfer_id()
        lease = self._leases.add(request_id, tid, lease_s, on_release)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll_releases())
        return TransferHandle(
            request_id=request_id,
            transfer_id=tid,
            kind=self.kind,
            regions=regions,
            signature=signature.to_dict(),
            lease_expiry=lease.expires_at,
            agent_name=self.name,
            agent_metadata=self._metadata,
            buffers=dict(self._buffers),
        )

    # ----------------------------------------------------------------- holder

    async def _poll_releases(self) -> None:
        """Apply release notifications; runs only while something is pinned."""
        while len(self._leases):
            for messages in self._agent.get_new_notifs().values():
                for message in messages:
                    self._apply_notification(message)
            await asyncio.sleep(self._poll_interval_s)

    def _apply_notification(self, message: bytes) -> None:
        parts = message.split(b" ")
        if len(parts) == 3 and parts[0] == _RELEASE:
            self._leases.release(parts[1].decode(), parts[2].decode())
        else:
            logger.warning("ignoring unexpected NIXL notification %r", message[:64])

    # ----------------------------------------------------------------- puller

    async def _pull(
        self, handle: TransferHandle, dest_regions: RequestRegions, dest: LayoutSignature
    ) -> None:
        rid = handle.request_id
        check_signature(rid, handle.signature, dest.to_dict())
        src_desc, dst_desc = handle.regions.descriptors, dest_regions.descriptors
        lengths = [r.length for r in src_desc], [r.length for r in dst_desc]
        if lengths[0] != lengths[1]:
            raise LayoutMismatch(
                rid,
                ["descriptors"],
                f"the source has {len(src_desc)} descriptors, this side {len(dst_desc)}; "
                f"allocate as many blocks (and a Mamba slot) as the source holds",
            )
        check_bounds(rid, dst_desc, self._sizes)
        # READs are one-sided: the holder cannot defer its lease while bytes
        # move, so a READ must start and end inside the lease.
        self._check_lease(handle)
        remote = self._remote_tables(handle)
        assert self._local is not None and handle.agent_name is not None
        xfers: list[Any] = []
        try:
            for (lkey, rkey), (lidx, ridx) in group_pairs(src_desc, dst_desc).items():
                xfer = self._agent.make_prepped_xfer(
                    "READ", self._local.handle(lkey), lidx, remote.handle(rkey), ridx
                )
                xfers.append(xfer)
                if self._agent.transfer(xfer) == "ERR":
                    raise PeerGone(rid, handle.peer, "NIXL refused to post the READ")
            await self._wait(handle, xfers)
        except PeerGone:
            self._forget(handle.agent_name)
            raise
        except Exception as exc:
            raise self._translate(handle, exc) from exc
        finally:
            for xfer in xfers:
                with contextlib.suppress(Exception):  # an unfinished READ is aborted here
                    xfer.release()
        self._check_lease(handle)
        self._agent.send_notif(
            handle.agent_name, b" ".join([_RELEASE, rid.encode(), handle.transfer_id.encode()])
        )

    async def _wait(self, handle: TransferHandle, xfers: list[Any]) -> None:
        """Poll until every READ is done: yield-only first (sub-ms blocks), then back off."""
        start = time.monotonic()
        pending = list(xfers)
        while pending:
            states = [self._agent.check_xfer_state(x) for x in pending]
            if "ERR" in states:
                raise PeerGone(handle.request_id, handle.peer, "a NIXL READ failed")
            pending = [x for x, s in zip(pending, states, strict=True) if s != "DONE"]
            if pending:
                # Yield-only while a transfer is young (throughput), then back off (CPU).
                elapsed = time.monotonic() - start
                await asyncio.sleep(0 if elapsed < _BUSY_POLL_S else 0.0005)

    @staticmethod
    def _check_lease(handle: TransferHandle) -> None:
        """Raise `UnknownRequest` once the holder may have freed the blocks."""
        if time.time() >= handle.lease_expiry:
            raise UnknownRequest(handle.request_id, handle.peer)

    def _translate(self, handle: TransferHandle, exc: Exception) -> Exception:
        """NIXL binding errors as transfer errors; anything else unchanged."""
        name = type(exc).__name__
        if name in _PEER_ERRORS:
            assert handle.agent_name is not None
            self._forget(handle.agent_name)
            return PeerGone(handle.request_id, handle.peer, f"NIXL: {name}")
        if name.startswith("nixl"):
            return TransferError(f"NIXL failed on request {handle.request_id!r}: {name} {exc}")
        return exc

    def _remote_tables(self, handle: TransferHandle) -> PreparedTables:
        peer = handle.agent_name
        if peer is None or handle.agent_metadata is None:
            raise LayoutMismatch(handle.request_id, ["agent_name"], "handle has no NIXL agent")
        tables = self._remote.get(peer)
        if tables is not None and self._remote_metadata.get(peer) != handle.agent_metadata:
            # The same agent name with new metadata: the holder was restarted.
            self._forget(peer)
            tables = None
        if tables is None:
            try:
                self._agent.add_remote_agent(handle.agent_metadata)
            except Exception as exc:
                raise PeerGone(handle.request_id, handle.peer, f"bad metadata: {exc}") from exc
            tables = PreparedTables(handle.buffers, self._prepare(peer))
            self._remote[peer] = tables
            self._remote_metadata[peer] = handle.agent_metadata
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

    def _notify_abort(self, handle: TransferHandle) -> None:
        if handle.agent_name is None or handle.agent_name not in self._remote:
            return
        message = b" ".join([_RELEASE, handle.request_id.encode(), handle.transfer_id.encode()])
        with contextlib.suppress(Exception):
            self._agent.send_notif(handle.agent_name, message)


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
