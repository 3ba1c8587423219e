"""A worker's registered pool buffers as a connection (TCP or UCX) sees them.

Host (CPU) buffers go over the connection directly: sends from memoryviews of
the pool, receives straight into the destination bytes. Device (CUDA) buffers
are not handed to the transport, so their bytes pass through a few reusable
host staging chunks (pinned when CUDA is present): device -> chunk -> wire on
the sender, wire -> chunk -> device on the receiver.

    host buffer:    pool[off:off+n] ==send==> recv_into ==> pool[off:off+n]
    device buffer:  pool --copy--> chunk ==send==> recv_into chunk --copy--> pool

Both sides cut every range into the same `payload_pieces` (one staging chunk
and, on UCX, one message each). The sender takes its flow-control budget per
batch of host pieces up to `PAYLOAD_PIECE_BYTES`, so many small ranges cost
one budget slice and, on TCP, one system call per batch.

Strided runs (`Runs`: `count` runs of `run` bytes, `stride` apart, as a
head slice of KV blocks is) go out as one view per run, from the pool, and
are received the same way: no run is gathered into a copy on either side.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import numpy as np
import torch

from kvcache.layout import Region
from transfer.head_slices import SlicePair
from transfer.python.connection import PAYLOAD_PIECE_BYTES, Connection, payload_pieces
from transfer.python.flow import ByteBudget

# (buffer, offset, run, count, stride): `count` runs of `run` bytes, `stride` apart.
Runs = tuple[str, int, int, int, int]
# Runs at least this long are received in place, one view each, on a byte
# stream (a few hundred per system call); shorter ones through a staging chunk.
DIRECT_RUN_BYTES = 4096


def host_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a flat uint8 CPU tensor (no copy)."""
    return tensor.numpy().data.cast("B")


_scatter_executor: ThreadPoolExecutor | None = None


def _scatter_thread() -> ThreadPoolExecutor:
    """The process's one thread for scatter copies (created on first use)."""
    global _scatter_executor
    if _scatter_executor is None:
        _scatter_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-scatter")
    return _scatter_executor


def _scatter(target: torch.Tensor, p: SlicePair, start: int, data: torch.Tensor) -> None:
    """Put bytes `[start, start + len(data))` of the pair's runs, laid end to
    end, into their places in `target` (the destination buffer): whole runs by
    one strided copy, a run the chunk cuts through by a copy of its part."""
    run, stride, base = p.run, p.dst_stride, int(target.storage_offset()) + p.dst_offset
    pos, end, done = start, start + data.numel(), 0
    while pos < end:
        index, inner = divmod(pos, run)
        if inner or end - pos < run:
            n = min(run - inner, end - pos)
            at = p.dst_offset + index * stride + inner
            target[at : at + n].copy_(data[done : done + n])
        else:
            rows = (end - pos) // run
            n = rows * run
            _copy_rows(target, base + index * stride, stride, data[done : done + n], run)
        pos += n
        done += n


_WIDE_TYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


def _copy_rows(
    target: torch.Tensor, offset: int, stride: int, data: torch.Tensor, run: int
) -> None:
    """Copy `data` (whole rows of `run` bytes) into rows `stride` bytes apart
    from byte `offset` of `target`'s storage, in the widest element type all
    of them align to (a byte-wise strided copy is several times slower)."""
    for size, dtype in _WIDE_TYPES:
        aligned = (run, stride, offset, data.storage_offset(), target.storage_offset())
        if all(n % size == 0 for n in aligned) and target.numel() % size == 0:
            wide, source = target.view(dtype), data.view(dtype)
            rows = wide.as_strided(
                (data.numel() // run, run // size), (stride // size, 1), offset // size
            )
            rows.copy_(source.view(rows.shape))
            return
    rows = target.as_strided((data.numel() // run, run), (stride, 1), offset)
    rows.copy_(data.view(rows.shape))


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
    (device buffers are always staged)."""

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
        self._chunks: list[torch.Tensor] = []  # idle staging chunks
        self._arrays = {
            name: _Runs(t.numpy()) for name, t in buffers.items() if name in self._views
        }

    async def send(
        self, conn: Connection, ranges: Sequence[tuple[str, int, int]], budget: ByteBudget
    ) -> None:
        """Send the (buffer, offset, length) ranges in order, one budgeted batch at a time.

        Host pieces go out in batches of up to `PAYLOAD_PIECE_BYTES` per
        `send_views` (on TCP, many pieces per system call); device pieces
        one staging chunk at a time.
        """
        for nbytes, batch in self._send_batches(ranges):
            taken = await budget.acquire(nbytes)
            try:
                if isinstance(batch, torch.Tensor):
                    await self._send_staged(conn, batch)
                else:
                    await conn.send_views(batch)
            finally:
                await budget.release(taken)

    async def recv(self, conn: Connection, regions: Sequence[Region]) -> None:
        """Receive exactly the regions' bytes, in order, into them.

        Runs of host regions are one `recv_into_views` each, straight into the pool.
        """
        views: list[memoryview] = []
        for region in regions:
            pool = self._views.get(region.buffer)
            if pool is None:
                await conn.recv_into_views(views)
                views = []
                await self._recv_staged(conn, region)
                continue
            for start, n in payload_pieces(region.offset, region.length):
                views.append(pool[start : start + n])
        await conn.recv_into_views(views)

    async def send_runs(self, conn: Connection, runs: Sequence[Runs], budget: ByteBudget) -> None:
        """Send strided runs in order; host runs as views of the pool, batched
        up to `PAYLOAD_PIECE_BYTES` per send."""
        for nbytes, batch in self._run_batches(runs):
            taken = await budget.acquire(nbytes)
            try:
                await conn.send_views(batch)
            finally:
                await budget.release(taken)

    async def recv_runs(self, conn: Connection, runs: Sequence[Runs]) -> None:
        """Receive exactly the runs' bytes, in order, into them."""
        for _, batch in self._run_batches(runs):
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
        """Receive chunk k + 1 while chunk k is scattered on the scatter thread
        (torch copies without the GIL), so the holder keeps sending."""
        target = self._tensors[p.dst_buffer]
        loop = asyncio.get_running_loop()
        scattering: asyncio.Future[None] | None = None
        held: list[torch.Tensor] = []
        try:
            for start, n in payload_pieces(0, p.num_bytes):
                chunk = self._take_chunk()
                held.append(chunk)
                await conn.recv_into(host_view(chunk)[:n])
                if scattering is not None:
                    await scattering
                    self._chunks.append(held.pop(0))
                scattering = loop.run_in_executor(
                    _scatter_thread(), _scatter, target, p, start, chunk[:n]
                )
            if scattering is not None:
                await scattering
        finally:
            if scattering is not None and not scattering.done():
                # Cancelled mid-receive: the copy still reads its chunk.
                await asyncio.shield(scattering)
            self._chunks.extend(held)

    def _run_batches(self, runs: Sequence[Runs]) -> Iterator[tuple[int, list[memoryview]]]:
        """Views of every run, in batches of up to `PAYLOAD_PIECE_BYTES`.

        Device buffers and runs longer than a piece are cut by `payload_pieces`
        on both sides alike; short host runs are sliced from the pool's view
        directly (a head slice of a large request is tens of thousands of runs).
        """
        views: list[memoryview] = []
        nbytes = 0
        for buffer, offset, run, count, stride in runs:
            pool = self._views.get(buffer)
            if pool is None:
                raise ValueError(
                    f"buffer {buffer!r} is not in host memory; head slices move "
                    "between host buffers only"
                )
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
    ) -> Iterator[tuple[int, list[memoryview] | torch.Tensor]]:
        """(bytes, host views or a device slice to stage) for each budgeted send."""
        views: list[memoryview] = []
        nbytes = 0
        for buffer, offset, length in ranges:
            pool = self._views.get(buffer)
            for start, n in payload_pieces(offset, length):
                if views and (pool is None or nbytes + n > PAYLOAD_PIECE_BYTES):
                    yield nbytes, views
                    views, nbytes = [], 0
                if pool is None:
                    yield n, self._tensors[buffer][start : start + n]
                else:
                    views.append(pool[start : start + n])
                    nbytes += n
        if views:
            yield nbytes, views

    async def _recv_staged(self, conn: Connection, region: Region) -> None:
        target = self._tensors[region.buffer]
        for start, n in payload_pieces(region.offset, region.length):
            chunk = self._take_chunk()
            try:
                await conn.recv_into(host_view(chunk)[:n])
                target[start : start + n].copy_(chunk[:n])
            finally:
                self._chunks.append(chunk)

    async def _send_staged(self, conn: Connection, source: torch.Tensor) -> None:
        chunk = self._take_chunk()
        try:
            n = source.numel()
            chunk[:n].copy_(source)  # synchronous: the bytes are on the host after this
            await conn.send(host_view(chunk)[:n])
        finally:
            self._chunks.append(chunk)

    def _take_chunk(self) -> torch.Tensor:
        if self._chunks:
            return self._chunks.pop()
        return torch.empty(
            PAYLOAD_PIECE_BYTES, dtype=torch.uint8, pin_memory=torch.cuda.is_available()
        )
