"""The pure-Python transceiver: asyncio, msgpack headers, zero-copy bytes.

Each worker listens on its own address over one wire: TCP (the default) or
UCX (`cache_transceiver.wire`, `transfer.ucx_wire`). The handle names the
holder's wire and the puller dials it over that wire, so the puller needs no
setting of its own. A pull is one connection:

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

Connections stay open after a pull (a few per holder) and carry the next
pull or release frame, so a small transfer costs no connect or handshake.

The puller maps segments by (layer, block) / (Mamba layer, kind) into its own
layout, so V1 and V2 workers interoperate. Between ranks of different tensor
parallelism it asks for head slices (`transfer.head_slices`): a range in the
pull frame may then be strided, `[buffer, offset, run, count, stride]`, and
the holder sends each run from the pool as it lies. Ranges are checked against what the
holder published, and the `data` frame against the size the puller asked
for; a protocol violation closes that connection only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from kvcache.layout import LayoutSignature, RequestRegions
from transfer.base import Transceiver, TransferHandle
from transfer.connection import TCP, WIRES, Connection, ConnectionClosed, Wire
from transfer.errors import LayoutMismatch, PeerGone, UnknownRequest, WireError
from transfer.factory import create_wire, wire_unusable_reason
from transfer.flow import ByteBudget
from transfer.head_slices import SlicePair, plan_pull
from transfer.plan import Coverage, check_bounds, segment_regions
from transfer.socket_buffers import Runs, SocketBuffers
from transfer.wire import (
    MAX_HEADER_BYTES,
    client_handshake,
    expect,
    recv_header,
    send_header,
    server_handshake,
)

logger = logging.getLogger(__name__)

_HANDSHAKE_TIMEOUT_S = 10.0
# Dialing a live holder takes milliseconds. A dead UCX holder is only noticed
# when this runs out (ucxx does not surface a refused connection sooner), so
# it is kept short; TCP refusals arrive at once.
_CONNECT_TIMEOUT_S = 3.0
_MAX_IDLE_PER_PEER = 8  # authenticated connections kept open per holder


class _StaleConnection(ConnectionError):
    """A reused connection was closed before the holder answered the pull."""


class PythonTransceiver(Transceiver):
    """The Python transceiver over the worker's registered pool buffers.

    buffers: name -> flat uint8 tensor (`CacheTensors.buffers()`); host buffers
        move zero-copy, device buffers through host staging chunks.
    secret: shared by every worker of the cluster; peers without it are dropped.
    host/port: where to listen (the node's own address; port 0 picks one).
    wire: "tcp" or "ucx" (resolved, see `transfer.factory.resolve_wire`): what
        this worker listens on. Pulls dial whatever wire the handle names.
    max_inflight_bytes: bound on bytes being sent at once over all pulls.
    stage_through_host: copy host buffers through staging chunks as device
        buffers always are (off by default: host buffers go zero-copy).
    connect_timeout_s: how long dialing a holder may take (its handshake then
        has `_HANDSHAKE_TIMEOUT_S`).
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
        connect_timeout_s: float = _CONNECT_TIMEOUT_S,
    ) -> None:
        super().__init__()
        if not secret:
            raise ValueError("cache_transceiver secret must not be empty")
        if wire not in WIRES:
            raise ValueError(
                f"cache_transceiver.wire must be resolved to one of {WIRES}, got {wire!r}"
            )
        self._buffers = SocketBuffers(buffers, stage_through_host)
        self._sizes = self._buffers.sizes
        self._secret = secret
        self._host, self._port = host, port
        self.wire = wire
        self._budget = ByteBudget(max_inflight_bytes)
        self._max_header = max_header_bytes
        self._connect_timeout_s = connect_timeout_s
        self._endpoint: tuple[str, int] | None = None
        self._wires: dict[str, Wire] = {}
        self._release_tasks: set[asyncio.Task[None]] = set()
        self._serving: dict[str, set[asyncio.Task[Any]]] = {}
        self._idle: dict[tuple[str, str, int], list[Connection]] = {}

    @property
    def endpoint(self) -> tuple[str, int]:
        if self._endpoint is None:
            raise RuntimeError("PythonTransceiver.start() has not run")
        return self._endpoint

    async def start(self) -> None:
        wire = self._wire(self.wire)
        self._endpoint = await wire.listen(self._host, self._port, self._serve)

    async def close(self) -> None:
        # Pulls end before the wires close: a UCX context is only reset once
        # no request of it is in flight.
        tasks = [*self._release_tasks, *self._pulls.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
        for wire in self._wires.values():
            await wire.close()
        self._leases.release_all()

    def publish(
        self,
        request_id: str,
        regions: RequestRegions,
        signature: LayoutSignature,
        lease_s: float,
        on_release: Callable[[str], None],
    ) -> TransferHandle:
        check_bounds(request_id, segment_regions(regions), self._sizes)
        tid = self._transfer_id_for(request_id)
        self._leases.add(request_id, tid, lease_s, on_release, Coverage(segment_regions(regions)))
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
        for task in self._serving.pop(request_id, set()):
            task.cancel()

    def _wire(self, name: str) -> Wire:
        wire = self._wires.get(name)
        if wire is None:
            wire = self._wires[name] = create_wire(name)
        return wire

    # ----------------------------------------------------------------- holder

    async def _serve(self, conn: Connection) -> None:
        """One authenticated connection; serves requests until the peer hangs up."""
        try:
            await asyncio.wait_for(server_handshake(conn, self._secret), _HANDSHAKE_TIMEOUT_S)
            while True:
                try:
                    request = await recv_header(conn, self._max_header)
                except ConnectionClosed:
                    return  # an idle pooled connection closed by its owner
                if request["t"] == "pull":
                    await self._serve_pull(conn, request)
                elif request["t"] == "release":
                    self._leases.release(str(request.get("rid")), str(request.get("tid")))
                    await send_header(conn, {"t": "released"})
                else:
                    raise WireError(f"unexpected {request['t']!r} frame")
        except (WireError, TimeoutError) as exc:
            logger.warning("dropping connection from %s: %s", conn.peer, exc)
        except (ConnectionError, OSError) as exc:
            logger.info("connection from %s ended early: %s", conn.peer, exc)

    async def _serve_pull(self, conn: Connection, request: dict[str, Any]) -> None:
        """Send the requested ranges of a published (leased) or offered request.

        A pull with `keep` set (offered blocks, or part of a cache) ends with
        the data; a full pull waits for the puller's release.
        """
        rid, tid = str(request.get("rid")), str(request.get("tid"))
        keep = request.get("keep") is True
        readable = self._readable(rid, tid, keep)
        if readable is None:
            await send_header(conn, {"t": "error", "code": "unknown", "message": rid})
            return
        coverage, begin_read, end_read = readable
        runs = _parse_ranges(request.get("ranges"), coverage, rid)
        strided = any(count > 1 for _, _, _, count, _ in runs)
        ranges = [(buffer, offset, run) for buffer, offset, run, _, _ in runs]
        if not conn.keeps_message_boundaries and not strided:
            # A byte stream may join ranges; a message wire sends them as the
            # puller receives them (see transfer.connection).
            ranges = _merge_adjacent(ranges)
        task = asyncio.current_task()
        assert task is not None
        serving = self._serving.setdefault(rid, set())
        serving.add(task)
        begin_read()
        try:
            await send_header(conn, {"t": "data", "n": sum(r[2] * r[3] for r in runs)})
            if strided:
                await self._buffers.send_runs(conn, runs, self._budget)
            else:
                await self._buffers.send(conn, ranges, self._budget)
        finally:
            serving.discard(task)
            if not serving and self._serving.get(rid) is serving:
                del self._serving[rid]
            end_read()
        if keep:
            return
        release = expect(await recv_header(conn, 1024), "release")
        if release.get("rid") == rid and release.get("tid") == tid:
            rank, of = release.get("rank", 0), release.get("of", 1)
            if not (isinstance(rank, int) and isinstance(of, int) and 0 <= rank < of):
                raise WireError(f"malformed release frame {release!r}")
            self._leases.release_by(rid, tid, rank, of)
        await send_header(conn, {"t": "released"})

    def _readable(
        self, rid: str, tid: str, keep: bool
    ) -> tuple[Coverage, Callable[[], None], Callable[[], None]] | None:
        """What a pull of (rid, tid) may read, and how to count it as a reader:
        a live lease (its expiry waits for the stream), or with `keep` an offer."""
        lease = self._leases.get(rid, tid)
        if lease is not None:
            leases = self._leases
            return (
                lease.payload,
                lambda: leases.begin_stream(lease),
                lambda: leases.end_stream(lease),
            )
        offer = self._offers.get(rid)
        if keep and offer is not None and offer.transfer_id == tid:
            return offer.coverage, offer.begin_read, offer.end_read
        return None

    # ----------------------------------------------------------------- puller

    async def _pull(
        self,
        handle: TransferHandle,
        dest_regions: RequestRegions,
        dest: LayoutSignature,
        release: bool,
    ) -> None:
        rid = handle.request_id
        _check_wire(handle)
        pairs = plan_pull(rid, handle.signature, handle.regions, dest, dest_regions)
        check_bounds(rid, [p.dest_span() for p in pairs], self._sizes)
        for attempt in range(2):
            conn, reused = await self._checkout(handle)
            try:
                await self._exchange(conn, handle, pairs, release, dest.tp_rank, dest.tp_size)
            except _StaleConnection as exc:
                conn.close()
                if reused and attempt == 0:
                    continue  # the holder dropped an idle connection; dial afresh
                raise PeerGone(rid, handle.peer, "connection closed before any reply") from exc
            except (ConnectionClosed, ConnectionResetError, BrokenPipeError) as exc:
                conn.close()
                raise PeerGone(rid, handle.peer, f"connection lost mid-transfer: {exc}") from exc
            except BaseException:
                conn.close()
                raise
            self._checkin(handle, conn)
            return

    async def _checkout(self, handle: TransferHandle) -> tuple[Connection, bool]:
        """An authenticated connection to the holder: (connection, was it reused)."""
        idle = self._idle.get(_peer_key(handle))
        if idle:
            return idle.pop(), True
        return await self._connect(handle), False

    def _checkin(self, handle: TransferHandle, conn: Connection) -> None:
        idle = self._idle.setdefault(_peer_key(handle), [])
        if len(idle) < _MAX_IDLE_PER_PEER:
            idle.append(conn)
        else:
            conn.close()

    async def _connect(self, handle: TransferHandle) -> Connection:
        assert handle.endpoint is not None
        wire = self._wire(handle.wire)
        try:
            conn = await wire.connect(handle.endpoint, self._connect_timeout_s)
        except TimeoutError as exc:
            reason = f"cannot connect within {self._connect_timeout_s:g} s"
            raise PeerGone(handle.request_id, handle.peer, reason) from exc
        except (ConnectionError, OSError) as exc:
            raise PeerGone(handle.request_id, handle.peer, f"cannot connect: {exc}") from exc
        try:
            async with asyncio.timeout(_HANDSHAKE_TIMEOUT_S):
                await client_handshake(conn, self._secret)
        except TimeoutError as exc:
            conn.close()
            raise WireError(
                f"{handle.peer} accepted the connection but sent no {handle.wire} handshake "
                f"within {_HANDSHAKE_TIMEOUT_S:g} s; is it a transceiver listening on that wire?"
            ) from exc
        except (ConnectionError, OSError) as exc:
            conn.close()
            raise PeerGone(handle.request_id, handle.peer, f"cannot connect: {exc}") from exc
        except BaseException:
            conn.close()
            raise
        return conn

    async def _exchange(
        self,
        conn: Connection,
        handle: TransferHandle,
        pairs: list[SlicePair],
        release: bool,
        rank: int,
        num_pullers: int,
    ) -> None:
        rid, tid = handle.request_id, handle.transfer_id
        ranges = [p.wire_range() for p in pairs]
        frame = {"t": "pull", "rid": rid, "tid": tid, "ranges": ranges, "keep": not release}
        try:
            await send_header(conn, frame)
            first = await recv_header(conn, 1024)
        except (ConnectionClosed, ConnectionResetError, BrokenPipeError) as exc:
            raise _StaleConnection() from exc
        if first["t"] == "error" and first.get("code") == "unknown":
            raise UnknownRequest(rid, handle.peer)
        declared = sum(p.num_bytes for p in pairs)
        if expect(first, "data").get("n") != declared:
            raise WireError(
                f"{handle.peer} announced {first.get('n')} bytes for request {rid!r} "
                f"where {declared} bytes were declared"
            )
        await self._buffers.recv_pairs(conn, pairs)
        if not release:
            return
        # Every rank of a tensor-parallel puller pulls from this holder; the
        # holder releases once all of them have.
        frame = {"t": "release", "rid": rid, "tid": tid, "rank": rank, "of": num_pullers}
        await send_header(conn, frame)
        expect(await recv_header(conn, 1024), "released")

    def _notify_abort(self, handle: TransferHandle) -> None:
        task = asyncio.ensure_future(self._send_release(handle))
        self._release_tasks.add(task)
        task.add_done_callback(self._release_tasks.discard)

    async def _send_release(self, handle: TransferHandle) -> None:
        """Tell the holder to free a request this side gave up on (best effort)."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_HANDSHAKE_TIMEOUT_S):
                conn = await self._connect(handle)
                try:
                    rid, tid = handle.request_id, handle.transfer_id
                    await send_header(conn, {"t": "release", "rid": rid, "tid": tid})
                    expect(await recv_header(conn, 1024), "released")
                finally:
                    conn.close()


def _check_wire(handle: TransferHandle) -> None:
    """Refuse, before dialing, a handle whose wire this worker cannot speak."""
    reason = wire_unusable_reason(handle.wire)
    if reason is not None:
        raise LayoutMismatch(
            handle.request_id,
            ["cache_transceiver.wire"],
            f"the holder {handle.peer} listens on {handle.wire!r}, which this worker "
            f"cannot dial: {reason}",
        )


def _peer_key(handle: TransferHandle) -> tuple[str, str, int]:
    assert handle.endpoint is not None
    return handle.wire, handle.endpoint[0], handle.endpoint[1]


def _parse_ranges(raw: object, coverage: Coverage, request_id: str) -> list[Runs]:
    """Validate a puller's ranges against what was published or offered for the request.

    A range is `[buffer, offset, length]` or, strided, `[buffer, offset, run,
    count, stride]`; every run must lie inside the request's published bytes.
    """
    if not isinstance(raw, list):
        raise WireError("malformed pull frame: 'ranges' is not a list")
    runs: list[Runs] = []
    for item in raw:
        if (
            not isinstance(item, list)
            or len(item) not in (3, 5)
            or not isinstance(item[0], str)
            or not all(isinstance(x, int) for x in item[1:])
        ):
            raise WireError(f"malformed range {item!r} in pull frame")
        buffer, offset, run = item[:3]
        count, stride = item[3:] if len(item) == 5 else (1, run)
        span = (count - 1) * stride + run
        if count < 1 or stride < run or not coverage.covers(buffer, offset, span):
            raise WireError(f"range {item!r} is outside request {request_id!r} or overlaps itself")
        runs.append((buffer, offset, run, count, stride))
    return runs


def _merge_adjacent(ranges: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Join consecutive ranges that continue each other in one buffer (fewer sends)."""
    merged: list[tuple[str, int, int]] = []
    for buffer, offset, length in ranges:
        if merged and merged[-1][0] == buffer and sum(merged[-1][1:]) == offset:
            merged[-1] = (buffer, merged[-1][1], merged[-1][2] + length)
        else:
            merged.append((buffer, offset, length))
    return merged
