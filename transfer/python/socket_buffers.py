"""A worker's registered pool buffers as a connection (TCP or UCX) sees them.

Host (CPU) buffers go over the connection directly: sends from memoryviews of
the pool, receives straight into the destination bytes. Device (CUDA) buffers
are not handed to the transport: their bytes pass through host staging
chunks, copied on the staging thread (`transfer.python.staging`):

    host buffer:    pool[off:off+n] ==send==> recv_into ==> pool[off:off+n]
    device buffer:  pool --copy--> chunk ==send==> recv_into chunk --copy--> pool

Both sides cut every range into the same `payload_pieces` (one staging chunk
and, on UCX, one message each). The sender takes its flow-control budget per
batch of host pieces up to `PAYLOAD_PIECE_BYTES`, so many small ranges cost
one budget slice and, on TCP, one system call per batch.

Strided runs (`Runs`: `count` runs of `run` bytes, `stride` apart, as a
head slice of KV blocks is) of a host buffer go out as one view per run, from
the pool, and are received the same way: no run is gathered into a copy on
either side. Those of a device buffer are gathered into (scattered from) a
staging chunk by one strided copy per chunk.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import TypeVar, cast

import numpy as np
import torch

from kvcache.layout import Region
from transfer.head_slices import SlicePair
from transfer.python.connection import PAYLOAD_PIECE_BYTES, Connection, payload_pieces
from transfer.python.flow import ByteBudget
from transfer.python.staging import (
    Runs,
    StagingChunks,
    after_queued_work,
    host_view,
    scatter_pair,
)

__all__ = ["DIRECT_RUN_BYTES", "Runs", "SocketBuffers"]

T = TypeVar("T")
# Runs at least this long are received in place, one view each, on a byte
# stream (a few hundred per system call); shorter ones through a staging chunk.
DIRECT_RUN_BYTES = 4096


class _Runs:
    """Strided runs of one host buffer as byte arrays, made by numpy.

    Each run is a one-dimensional view of the pool (no copy) that sockets take
    like a memoryview. Slicing a memoryview per run costs ten times as much
    and makes an object the garbage collector tracks, per run.
    """

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def __call__(self, offset: int, run: int, count: int, stride: int) -> list[memoryview]:
        rows = np.lib.stride_tricks.as_strided(
            self._array[offset:], shape=(count, run), strides=(stride, 1)
        )
        return cast(list[memoryview], list(rows))


class SocketBuffers:
    """Named flat uint8 buffers; `stage_through_host` forces staging for host buffers too
    (device buffers are always staged, `transfer.python.staging`)."""

    def __init__(self, buffers: Mapping[str, torch.Tensor], stage_through_host: bool = False):
        for name, tensor in buffers.items():
            if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
                raise ValueError(
                    f"buffer {name!r} must be a flat contiguous uint8 tensor, got "
                    f"{tensor.dtype} {tuple(tensor.shape)}"
                )
        self._tensors = dict(buffers)
        self.sizes = {name: t.numel() for name, t in buffers.items()}
        self._views = {
            name: host_view(t)
            for name, t in buffers.items()
            if t.device.type == "cpu" and not stage_through_host
        }
        self._arrays = {
            name: _Runs(t.numpy()) for name, t in buffers.items() if name in self._views
        }
        self._staging = StagingChunks(
            {name: t for name, t in buffers.items() if name not in self._views}
        )

    async def send(
        self, conn: Connection, ranges: Sequence[tuple[str, int, int]], budget: ByteBudget
    ) -> None:
        """Send the (buffer, offset, length) ranges in order, one budgeted batch at a time.

        Host pieces go out in batches of up to `PAYLOAD_PIECE_BYTES` per
        `send_views` (on TCP, many pieces per system call); device pieces
        one staging chunk at a time.
        """
        for staged, group in self._by_staging(ranges, lambda r: r[0]):
            if staged:
                await self._staging.send(conn, [(b, o, n, 1, n) for b, o, n in group], budget)
                continue
            for nbytes, batch in self._send_batches(group):
                taken = await budget.acquire(nbytes)
                try:
                    await conn.send_views(batch)
                finally:
                    await budget.release(taken)

    async def recv(self, conn: Connection, regions: Sequence[Region]) -> None:
        """Receive exactly the regions' bytes, in order, into them.

        Runs of host regions are one `recv_into_views` each, straight into the pool.
        """
        for staged, group in self._by_staging(regions, lambda r: r.buffer):
            if staged:
                await self._staging.recv(conn, [(b, o, n, 1, n) for b, o, n in group])
                continue
            views: list[memoryview] = []
            for region in group:
                pool = self._views[region.buffer]
                for start, n in payload_pieces(region.offset, region.length):
                    views.append(pool[start : start + n])
            await conn.recv_into_views(views)

    async def send_runs(self, conn: Connection, runs: Sequence[Runs], budget: ByteBudget) -> None:
        """Send strided runs in order; host runs as views of the pool, batched
        up to `PAYLOAD_PIECE_BYTES` per send, device runs gathered into
        staging chunks."""
        for staged, group in self._by_staging(runs, lambda r: r[0]):
            if staged:
                await self._staging.send(conn, group, budget)
                continue
            for nbytes, batch in self._run_batches(group):
                taken = await budget.acquire(nbytes)
                try:
                    await conn.send_views(batch)
                finally:
                    await budget.release(taken)

    async def recv_runs(self, conn: Connection, runs: Sequence[Runs]) -> None:
        """Receive exactly the runs' bytes, in order, into them."""
        for staged, group in self._by_staging(runs, lambda r: r[0]):
            if staged:
                await self._staging.recv(conn, group)
                continue
            for _, batch in self._run_batches(group):
                await conn.recv_into_views(batch)

    async def recv_pairs(self, conn: Connection, pairs: Sequence[SlicePair]) -> None:
        """Receive the pairs' bytes, cut as the holder sends them, into their
        destinations.

        The holder sends a pair whose source is one contiguous range as that
        range, and a strided one run by run; on a byte stream a contiguous
        destination takes either as one range. A contiguous source landing in
        strided runs here (more heads per block on this side) is received
        straight into the runs where the connection is a byte stream and the
        runs are long (head-outer blocks: a head of a block is
        `2 * block_size * head_dim` elements); else a staging chunk at a time,
        scattered by one strided copy per chunk, rather than as thousands of
        small receives.
        """
        # Consecutive pairs received alike are received together: a V1 head
        # slice is a pair per (layer, block), thousands in a large request.
        whole: list[Region] = []
        direct: list[Runs] = []
        stream = not conn.keeps_message_boundaries
        for p in pairs:
            if p.dest_is_contiguous and (stream or p.source_is_contiguous):
                await self.recv_runs(conn, direct)
                direct = []
                whole.append(Region(p.dst_buffer, p.dst_offset, p.num_bytes))
            elif not p.source_is_contiguous or (stream and p.run >= DIRECT_RUN_BYTES):
                await self.recv(conn, whole)
                whole = []
                direct.append((p.dst_buffer, p.dst_offset, p.run, p.num_runs, p.dst_stride))
            else:
                await self.recv(conn, whole)
                await self.recv_runs(conn, direct)
                whole, direct = [], []
                await self._recv_scattered(conn, p)
        await self.recv(conn, whole)
        await self.recv_runs(conn, direct)

    async def _recv_scattered(self, conn: Connection, p: SlicePair) -> None:
        """Receive chunk k + 1 while chunk k is scattered on the staging thread
        (torch copies without the GIL), so the holder keeps sending."""
        target = self._tensors[p.dst_buffer]
        after_queued_work({target.device})
        scattering: asyncio.Future[None] | None = None
        held: list[torch.Tensor] = []
        try:
            for start, n in payload_pieces(0, p.num_bytes):
                chunk = self._staging.take()
                held.append(chunk)
                await conn.recv_into(host_view(chunk)[:n])
                if scattering is not None:
                    await asyncio.shield(scattering)
                    self._staging.give_back(held.pop(0))
                copy = partial(scatter_pair, target, p, start, chunk[:n])
                scattering = self._staging.copy(target.device, copy)
            if scattering is not None:
                await asyncio.shield(scattering)
        finally:
            if scattering is not None and not scattering.done():
                # Cancelled mid-receive: the copy still reads its chunk.
                await asyncio.shield(scattering)
            for chunk in held:
                self._staging.give_back(chunk)

    def _by_staging(
        self, items: Sequence[T], buffer: Callable[[T], str]
    ) -> Iterator[tuple[bool, list[T]]]:
        """Consecutive items grouped by whether their buffer is staged."""
        for staged, group in itertools.groupby(items, lambda item: buffer(item) not in self._views):
            yield staged, list(group)

    def _run_batches(self, runs: Sequence[Runs]) -> Iterator[tuple[int, list[memoryview]]]:
        """Views of every run, in batches of up to `PAYLOAD_PIECE_BYTES`.

        Runs of host buffers only. Runs longer than a piece are cut by
        `payload_pieces` on both sides alike; short runs are sliced from the
        pool's view directly (a head slice of a large request is tens of
        thousands of runs).
        """
        views: list[memoryview] = []
        nbytes = 0
        for buffer, offset, run, count, stride in runs:
            pool = self._views[buffer]
            if run > PAYLOAD_PIECE_BYTES:
                if views:
                    yield nbytes, views
                    views, nbytes = [], 0
                for i in range(count):
                    for start, n in payload_pieces(offset + i * stride, run):
                        yield n, [pool[start : start + n]]
                continue
            runs_of = self._arrays[buffer]
            done = 0
            while done < count:
                rows = min(count - done, (PAYLOAD_PIECE_BYTES - nbytes) // run)
                if rows == 0:
                    yield nbytes, views
                    views, nbytes = [], 0
                    continue
                views += runs_of(offset + done * stride, run, rows, stride)
                nbytes += rows * run
                done += rows
        if views:
            yield nbytes, views

    def _send_batches(
        self, ranges: Sequence[tuple[str, int, int]]
    ) -> Iterator[tuple[int, list[memoryview]]]:
        """(bytes, views) of host ranges for each budgeted send."""
        views: list[memoryview] = []
        nbytes = 0
        for buffer, offset, length in ranges:
            pool = self._views[buffer]
            for start, n in payload_pieces(offset, length):
                if views and nbytes + n > PAYLOAD_PIECE_BYTES:
                    yield nbytes, views
                    views, nbytes = [], 0
                views.append(pool[start : start + n])
                nbytes += n
        if views:
            yield nbytes, views
