"""Host staging: the bytes of pool buffers a connection cannot read or write in place.

A connection sends from and receives into host memory. The bytes of a GPU
buffer (or of a host buffer with `stage_through_host`) therefore pass through
reusable host chunks of `PAYLOAD_PIECE_BYTES`, pinned where CUDA is present:

    sender:    pool runs --gather--> chunk ==send==>
    receiver:               ==recv_into==> chunk --scatter--> pool runs

A chunk holds whole runs laid end to end; a run longer than a chunk is cut by
`payload_pieces`, as the host path cuts it. So a message wire sees one message
per run (or piece) on both sides, and a staged side talks to an unstaged one.

Every copy runs on the staging thread, never on the event loop, and for a
CUDA buffer on a copy stream of its own, which the thread waits for before a
chunk is sent or reused: a pull neither stalls the loop nor queues behind the
forward on the compute stream. Chunk k + 1 is gathered while chunk k is sent,
and chunk k - 1 scattered while chunk k is received.

Ordering against the compute stream: a holder's blocks are offered or
published only once the step that wrote them has completed (the step barrier,
`engine.step_event`). A receive into a CUDA buffer first makes its copy
stream wait for the work queued on the device's default stream when it began,
so a kernel still writing a block's previous owner cannot land after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch

from transfer.head_slices import SlicePair
from transfer.python.connection import PAYLOAD_PIECE_BYTES, Connection, payload_pieces
from transfer.python.flow import ByteBudget

# (buffer, offset, run, count, stride): `count` runs of `run` bytes, `stride` apart.
Runs = tuple[str, int, int, int, int]
# What one chunk holds: whole runs, at most `PAYLOAD_PIECE_BYTES` in all.
ChunkPlan = list[Runs]

_staging_executor: ThreadPoolExecutor | None = None
_copy_streams: dict[int, torch.cuda.Stream] = {}
_copy_streams_lock = threading.Lock()


def staging_thread() -> ThreadPoolExecutor:
    """The process's one thread for staging copies (created on first use)."""
    global _staging_executor
    if _staging_executor is None:
        _staging_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-staging")
    return _staging_executor


def host_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a flat uint8 CPU tensor (no copy)."""
    return tensor.numpy().data.cast("B")


def chunk_plans(runs: Sequence[Runs]) -> Iterator[ChunkPlan]:
    """The runs cut into chunks, in order: short runs packed whole, a run
    longer than a chunk one `payload_pieces` piece a chunk."""
    plan: ChunkPlan = []
    used = 0
    for buffer, offset, run, count, stride in runs:
        if run > PAYLOAD_PIECE_BYTES:
            if plan:
                yield plan
                plan, used = [], 0
            for i in range(count):
                for start, n in payload_pieces(offset + i * stride, run):
                    yield [(buffer, start, n, 1, n)]
            continue
        done = 0
        while done < count:
            rows = min(count - done, (PAYLOAD_PIECE_BYTES - used) // run)
            if rows == 0:
                yield plan
                plan, used = [], 0
                continue
            plan.append((buffer, offset + done * stride, run, rows, stride))
            used += rows * run
            done += rows
    if plan:
        yield plan


def plan_bytes(plan: ChunkPlan) -> int:
    return sum(run * count for _, _, run, count, _ in plan)


def chunk_views(chunk: torch.Tensor, plan: ChunkPlan, per_run: bool) -> list[memoryview]:
    """Where the plan's bytes lie in `chunk`: one view of them all, or with
    `per_run` one per run (a message wire's messages)."""
    n = plan_bytes(plan)
    if not per_run:
        return [host_view(chunk)[:n]]
    array, views, at = chunk.numpy(), [], 0
    for _, _, run, count, _ in plan:
        rows = array[at : at + run * count].reshape(count, run)
        views += [row.data for row in rows]
        at += run * count
    return views


_WIDE_TYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


def _rows(
    tensor: torch.Tensor, offset: int, run: int, count: int, stride: int, size: int
) -> torch.Tensor:
    """`count` rows of `run` bytes `stride` apart from byte `offset` of a
    flat uint8 tensor, viewed in elements of `size` bytes."""
    start = int(tensor.storage_offset()) + offset
    if size == 1:
        return tensor.as_strided((count, run), (stride, 1), start)
    dtype = next(d for s, d in _WIDE_TYPES if s == size)
    return tensor.view(dtype).as_strided((count, run // size), (stride // size, 1), start // size)


def copy_runs(
    pool: torch.Tensor,
    runs: Runs,
    chunk: torch.Tensor,
    at: int,
    to_chunk: bool,
) -> None:
    """Copy strided runs of `pool` to bytes `[at, at + run * count)` of
    `chunk`, laid end to end (or back, without `to_chunk`), in one copy of
    the widest element type both sides align to (a byte-wise strided copy is
    several times slower)."""
    _, offset, run, count, stride = runs
    size = _widest(
        (run, stride, offset, at, int(pool.storage_offset()), int(chunk.storage_offset())),
        (pool.numel(), chunk.numel()),
    )
    held = _rows(pool, offset, run, count, stride, size)
    laid = _rows(chunk, at, run, count, run, size)
    if to_chunk:
        laid.copy_(held, non_blocking=True)
    else:
        held.copy_(laid, non_blocking=True)


def _widest(positions: Sequence[int], lengths: Sequence[int]) -> int:
    for size, _ in _WIDE_TYPES:
        if all(n % size == 0 for n in (*positions, *lengths)):
            return size
    return 1


def gather(pools: Mapping[str, torch.Tensor], plan: ChunkPlan, chunk: torch.Tensor) -> None:
    """The plan's runs into `chunk`, end to end (on the staging thread)."""
    at = 0
    for runs in plan:
        copy_runs(pools[runs[0]], runs, chunk, at, to_chunk=True)
        at += runs[2] * runs[3]


def scatter(pools: Mapping[str, torch.Tensor], plan: ChunkPlan, chunk: torch.Tensor) -> None:
    """`chunk`'s bytes, end to end, into the plan's runs (on the staging thread)."""
    at = 0
    for runs in plan:
        copy_runs(pools[runs[0]], runs, chunk, at, to_chunk=False)
        at += runs[2] * runs[3]


def scatter_pair(target: torch.Tensor, p: SlicePair, start: int, data: torch.Tensor) -> None:
    """Put bytes `[start, start + len(data))` of the pair's destination runs,
    laid end to end, into their places in `target`: whole runs by one strided
    copy, a run the chunk cuts through by a copy of its part."""
    run, stride = p.run, p.dst_stride
    pos, end, done = start, start + data.numel(), 0
    while pos < end:
        index, inner = divmod(pos, run)
        if inner or end - pos < run:
            n = min(run - inner, end - pos)
            at = p.dst_offset + index * stride + inner
            target[at : at + n].copy_(data[done : done + n], non_blocking=True)
        else:
            n = (end - pos) // run * run
            runs = (p.dst_buffer, p.dst_offset + index * stride, run, n // run, stride)
            copy_runs(target, runs, data, done, to_chunk=False)
        pos += n
        done += n


def on_copy_stream(device: torch.device, copy: Callable[[], None]) -> None:
    """Run `copy` (on the staging thread); for a CUDA device on its copy
    stream, returning once the stream has finished it."""
    if device.type != "cuda":
        copy()
        return
    stream = copy_stream(device)
    with torch.cuda.stream(stream):
        copy()
    stream.synchronize()


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The staging copies' stream on a CUDA device (one per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _copy_streams_lock:
        stream = _copy_streams.get(index)
        if stream is None:
            stream = _copy_streams[index] = torch.cuda.Stream(device=index)
        return stream


def after_queued_work(devices: set[torch.device]) -> None:
    """Make the copy streams of `devices` wait (on the device, not here)
    for the work queued on each device's default stream by now."""
    for device in devices:
        if device.type == "cuda":
            copy_stream(device).wait_stream(torch.cuda.default_stream(device))


@dataclass
class _Staged:
    """A chunk in use: the runs it holds and its copy (None until started)."""

    chunk: torch.Tensor
    plan: ChunkPlan
    copying: asyncio.Future[None] | None = None


class StagingChunks:
    """Reusable host chunks of `PAYLOAD_PIECE_BYTES` and the staged sends
    and receives over them; `pools` are the buffers staged."""

    def __init__(self, pools: Mapping[str, torch.Tensor]) -> None:
        self._pools = dict(pools)
        self._idle: list[torch.Tensor] = []

    def take(self) -> torch.Tensor:
        if self._idle:
            return self._idle.pop()
        return torch.empty(
            PAYLOAD_PIECE_BYTES, dtype=torch.uint8, pin_memory=torch.cuda.is_available()
        )

    def give_back(self, chunk: torch.Tensor) -> None:
        self._idle.append(chunk)

    def copy(self, target: torch.device, copy: Callable[[], None]) -> asyncio.Future[None]:
        """Start `copy` on the staging thread (on `target`'s copy stream if a GPU).

        Await the result through `asyncio.shield`: a cancelled waiter must
        not mark the copy done while the thread still uses its chunk.
        """
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(staging_thread(), on_copy_stream, target, copy)

    async def send(self, conn: Connection, runs: Sequence[Runs], budget: ByteBudget) -> None:
        """Send the runs' bytes in order, gathering chunk k + 1 while chunk k is sent."""
        pending: list[_Staged] = []
        try:
            for plan in chunk_plans(runs):
                staged = _Staged(self.take(), plan)
                pending.append(staged)
                staged.copying = self.copy(
                    self._device(plan), partial(gather, self._pools, plan, staged.chunk)
                )
                if len(pending) > 1:
                    await self._send_first(conn, pending, budget)
            while pending:
                await self._send_first(conn, pending, budget)
        finally:
            await self._settle(pending)

    async def _send_first(
        self, conn: Connection, pending: list[_Staged], budget: ByteBudget
    ) -> None:
        staged = pending[0]
        assert staged.copying is not None
        await asyncio.shield(staged.copying)
        taken = await budget.acquire(plan_bytes(staged.plan))
        try:
            views = chunk_views(staged.chunk, staged.plan, conn.keeps_message_boundaries)
            await conn.send_views(views)
        finally:
            await budget.release(taken)
        self.give_back(pending.pop(0).chunk)

    async def recv(self, conn: Connection, runs: Sequence[Runs]) -> None:
        """Receive exactly the runs' bytes, in order, into them, scattering
        chunk k - 1 while chunk k is received."""
        after_queued_work({self._pools[name].device for name, *_ in runs})
        pending: list[_Staged] = []
        try:
            for plan in chunk_plans(runs):
                staged = _Staged(self.take(), plan)
                pending.append(staged)
                views = chunk_views(staged.chunk, plan, conn.keeps_message_boundaries)
                await conn.recv_into_views(views)
                if len(pending) > 1:
                    await self._finish_first(pending)
                staged.copying = self.copy(
                    self._device(plan), partial(scatter, self._pools, plan, staged.chunk)
                )
            while pending:
                await self._finish_first(pending)
        finally:
            await self._settle(pending)

    async def _finish_first(self, pending: list[_Staged]) -> None:
        copying = pending[0].copying
        assert copying is not None
        await asyncio.shield(copying)
        self.give_back(pending.pop(0).chunk)

    async def _settle(self, pending: list[_Staged]) -> None:
        """After a failure or cancellation: let the copies still running
        finish (they use their chunks), then take the chunks back."""
        for staged in pending:
            if staged.copying is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(staged.copying)
            self.give_back(staged.chunk)
        pending.clear()

    def _device(self, plan: ChunkPlan) -> torch.device:
        """The device a chunk's copy runs on: its buffers' (one worker's pool)."""
        return self._pools[plan[0][0]].device
