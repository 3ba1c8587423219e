"""The holder side of the Python transceiver: serving pulls of published and offered requests.

Each accepted connection is authenticated, then serves `pull` and `release`
frames until the puller hangs up. A pull's ranges are checked against what
the holder published (or offered) for the request; a strided range
(`[buffer, offset, run, count, stride]`, from a puller of another tensor
parallelism) is sent run by run from the pool as it lies. A protocol
violation closes that connection only.

A pull with `keep` set (offered blocks, or part of a cache) ends with the
data; a full pull waits for the puller's release, and the request is freed
(`on_release`) once all `of` puller ranks released it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from transfer.errors import WireError
from transfer.leases import LeaseTable
from transfer.offers import Offer
from transfer.plan import Coverage
from transfer.python.connection import Connection, ConnectionClosed
from transfer.python.flow import ByteBudget
from transfer.python.frames import (
    HANDSHAKE_TIMEOUT_S,
    expect,
    recv_header,
    send_header,
    server_handshake,
)
from transfer.python.socket_buffers import Runs, SocketBuffers

logger = logging.getLogger(__name__)


class PythonHolder:
    """Serves the pulls of one transceiver's leases and offers, on the event loop.

    max_inflight_bytes: bound on bytes being sent at once over all pulls.
    max_header_bytes: the largest request frame a puller may send.
    """

    def __init__(
        self,
        buffers: SocketBuffers,
        secret: bytes,
        leases: LeaseTable,
        offers: dict[str, Offer],
        max_inflight_bytes: int,
        max_header_bytes: int,
    ) -> None:
        self._buffers = buffers
        self._secret = secret
        self._leases = leases
        self._offers = offers
        self._budget = ByteBudget(max_inflight_bytes)
        self._max_header = max_header_bytes
        # Tasks sending a request's bytes, by request id.
        self._serving: dict[str, set[asyncio.Task[Any]]] = {}

    def stop_reads(self, request_id: str) -> None:
        """Cancel every send of the request's bytes in flight."""
        for task in self._serving.pop(request_id, set()):
            task.cancel()

    async def serve(self, conn: Connection) -> None:
        """One authenticated connection; serves requests until the peer hangs up."""
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                await server_handshake(conn, self._secret)
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
            # puller receives them (see transfer.python.connection).
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
