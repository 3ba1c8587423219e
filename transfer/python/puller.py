"""The puller side of the Python transceiver: dialing holders, pulling, releasing.

The handle names the holder's wire and the puller dials it over that wire,
so the puller needs no setting of its own. Connections stay open after a
pull (a few per holder) and carry the next pull or release frame, so a small
transfer costs no connect or handshake.

The puller maps segments by (layer, block) / (Mamba layer, kind) into its own
layout, so V1 and V2 workers interoperate. Between ranks of different tensor
parallelism it asks for head slices (`transfer.head_slices`): a range in the
pull frame may then be strided, `[buffer, offset, run, count, stride]`. The
`data` frame is checked against the size the puller asked for, and the bytes
are received straight into each destination segment.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from kvcache.layout import LayoutSignature, RequestRegions
from transfer.errors import LayoutMismatch, PeerGone, UnknownRequest, WireError
from transfer.handle import TransferHandle
from transfer.head_slices import SlicePair, plan_pull
from transfer.plan import check_bounds
from transfer.python.connection import Connection, ConnectionClosed, Wire
from transfer.python.frames import (
    HANDSHAKE_TIMEOUT_S,
    client_handshake,
    expect,
    recv_header,
    send_header,
)
from transfer.python.socket_buffers import SocketBuffers
from transfer.python.wires import wire_unusable_reason

# Dialing a live holder takes milliseconds. A dead UCX holder is only noticed
# when this runs out (ucxx does not surface a refused connection sooner), so
# it is kept short; TCP refusals arrive at once.
CONNECT_TIMEOUT_S = 3.0
_MAX_IDLE_PER_PEER = 8  # authenticated connections kept open per holder


class _StaleConnection(ConnectionError):
    """A reused connection was closed before the holder answered the pull."""


class PythonPuller:
    """The pulls of one transceiver and its pool of idle connections, on the event loop.

    wire: the transceiver's wire of a name ("tcp" or "ucx"), made on first use;
        the transceiver closes them.
    connect_timeout_s: how long dialing a holder may take (its handshake then
        has `HANDSHAKE_TIMEOUT_S`).
    """

    def __init__(
        self,
        buffers: SocketBuffers,
        secret: bytes,
        wire: Callable[[str], Wire],
        connect_timeout_s: float,
    ) -> None:
        self._buffers = buffers
        self._secret = secret
        self._wire = wire
        self._connect_timeout_s = connect_timeout_s
        self._release_tasks: set[asyncio.Task[None]] = set()
        self._idle: dict[tuple[str, str, int], list[Connection]] = {}

    @property
    def release_tasks(self) -> list[asyncio.Task[None]]:
        """Releases of aborted pulls still being sent (`notify_abort`)."""
        return list(self._release_tasks)

    def close_idle(self) -> None:
        """Close every pooled connection (the transceiver is closing)."""
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()

    async def pull(
        self,
        handle: TransferHandle,
        dest_regions: RequestRegions,
        dest: LayoutSignature,
        release: bool,
    ) -> None:
        """`Transceiver._pull`: move the bytes and, with `release`, release the holder."""
        rid = handle.request_id
        _check_wire(handle)
        pairs = plan_pull(rid, handle.signature, handle.regions, dest, dest_regions)
        check_bounds(rid, [p.dest_span() for p in pairs], self._buffers.sizes)
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

    def notify_abort(self, handle: TransferHandle) -> None:
        """`Transceiver._notify_abort`: release the holder in the background."""
        task = asyncio.ensure_future(self._send_release(handle))
        self._release_tasks.add(task)
        task.add_done_callback(self._release_tasks.discard)

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
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                await client_handshake(conn, self._secret)
        except TimeoutError as exc:
            conn.close()
            raise WireError(
                f"{handle.peer} accepted the connection but sent no {handle.wire} handshake "
                f"within {HANDSHAKE_TIMEOUT_S:g} s; is it a transceiver listening on that wire?"
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

    async def _send_release(self, handle: TransferHandle) -> None:
        """Tell the holder to free a request this side gave up on (best effort)."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
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
