"""The pure-Python transceiver: asyncio, msgpack headers, zero-copy bytes.

Each worker listens on its own address over one wire: TCP (the default) or
UCX (`cache_transceiver.wire`, `transfer.python.ucx_wire`), and dials whatever wire
a handle names. A pull is one connection:

    puller                                   holder
      | <------ challenge (nonce) ------------- |   shared-secret handshake
      | ------- auth (HMAC) ------------------> |
      | <------ welcome ----------------------- |
      | ------- pull {rid, tid, ranges} ------> |   ranges: coalesced source spans
      | <------ data {n} + n raw bytes -------- |   n = sum of the ranges, sent
      |                                         |   from memoryviews of the pool
      |                                         |   (TCP: sendmsg over many views),
      |                                         |   received with recvmsg_into
      |                                         |   straight into each segment
      | ------- release {rid, tid, rank, of} -> |   holder frees (on_release) once
      |                                         |   all `of` puller ranks released
      | <------ released ---------------------- |

`PythonTransceiver` is the `Transceiver` over both sides and owns the wires
they share; the rest lives in modules of their own:

    transfer.python.holder   serving pulls and releases of leases and offers
    transfer.python.puller   dialing (pooled connections), pulling, releasing
    transfer.python.frames            the frames and the handshake above
    transfer.python.socket_buffers  sending and receiving the pool's bytes
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import torch

from kvcache.layout import LayoutSignature, RequestRegions
from transfer.base import Transceiver
from transfer.handle import TransferHandle
from transfer.plan import Coverage, check_bounds
from transfer.python.connection import TCP, WIRES, Wire
from transfer.python.frames import MAX_HEADER_BYTES
from transfer.python.holder import PythonHolder
from transfer.python.puller import CONNECT_TIMEOUT_S, PythonPuller
from transfer.python.socket_buffers import SocketBuffers
from transfer.python.wires import create_wire
from transfer.region_arrays import segment_arrays


class PythonTransceiver(Transceiver):
    """The Python transceiver over the worker's registered pool buffers.

    buffers: name -> flat uint8 tensor (`CacheTensors.buffers()`); host buffers
        move zero-copy, device buffers through host staging chunks.
    secret: shared by every worker of the cluster; peers without it are dropped.
    host/port: where to listen (the node's own address; port 0 picks one).
    wire: "tcp" or "ucx" (resolved, see `transfer.python.wires.resolve_wire`): what
        this worker listens on. Pulls dial whatever wire the handle names.
    max_inflight_bytes: bound on bytes being sent at once over all pulls.
    stage_through_host: copy host buffers through staging chunks as device
        buffers always are (off by default: host buffers go zero-copy).
    connect_timeout_s: how long dialing a holder may take (its handshake then
        has `transfer.python.frames.HANDSHAKE_TIMEOUT_S`).
    """

    kind = "python"

    def __init__(
        self,
        buffers: Mapping[str, torch.Tensor],
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        max_inflight_bytes: int = 256 << 20,
        max_header_bytes: int = MAX_HEADER_BYTES,
        stage_through_host: bool = False,
        wire: str = TCP,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        super().__init__()
        if not secret:
            raise ValueError("cache_transceiver secret must not be empty")
        if wire not in WIRES:
            raise ValueError(
                f"cache_transceiver.wire must be resolved to one of {WIRES}, got {wire!r}"
            )
        self._buffers = SocketBuffers(buffers, stage_through_host)
        self._host, self._port = host, port
        self.wire = wire
        self._endpoint: tuple[str, int] | None = None
        self._wires: dict[str, Wire] = {}
        self._holder = PythonHolder(
            self._buffers, secret, self._leases, self._offers, max_inflight_bytes, max_header_bytes
        )
        self._puller = PythonPuller(self._buffers, secret, self._wire, connect_timeout_s)

    @property
    def endpoint(self) -> tuple[str, int]:
        if self._endpoint is None:
            raise RuntimeError("PythonTransceiver.start() has not run")
        return self._endpoint

    async def start(self) -> None:
        wire = self._wire(self.wire)
        self._endpoint = await wire.listen(self._host, self._port, self._holder.serve)

    async def close(self) -> None:
        # Pulls end before the wires close: a UCX context is only reset once
        # no request of it is in flight.
        tasks = [*self._puller.release_tasks, *self._pulls.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._puller.close_idle()
        for wire in self._wires.values():
            await wire.close()
        self._leases.release_all()

    def _wire(self, name: str) -> Wire:
        wire = self._wires.get(name)
        if wire is None:
            wire = self._wires[name] = create_wire(name)
        return wire

    # ----------------------------------------------------------------- holder

    def publish(
        self,
        request_id: str,
        regions: RequestRegions,
        signature: LayoutSignature,
        lease_s: float,
        on_release: Callable[[str], None],
    ) -> TransferHandle:
        segments = segment_arrays(regions)
        check_bounds(request_id, segments, self._buffers.sizes)
        tid = self._transfer_id_for(request_id)
        self._leases.add(request_id, tid, lease_s, on_release, Coverage(segments))
        return self._handle(request_id, tid, regions, signature)

    def _handle(
        self,
        request_id: str,
        transfer_id: str,
        regions: RequestRegions,
        signature: LayoutSignature,
    ) -> TransferHandle:
        return TransferHandle(
            request_id=request_id,
            transfer_id=transfer_id,
            kind=self.kind,
            regions=regions,
            signature=signature.to_dict(),
            endpoint=self.endpoint,
            wire=self.wire,
        )

    def abort(self, request_id: str) -> None:
        # Stop streams first: once cancelled, nothing reads the pool (a UCX
        # connection aborts its endpoint on cancellation), so `on_release`
        # may hand the blocks to someone else right away.
        self._stop_reads(request_id)
        super().abort(request_id)

    def _stop_reads(self, request_id: str) -> None:
        self._holder.stop_reads(request_id)

    # ----------------------------------------------------------------- puller

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
