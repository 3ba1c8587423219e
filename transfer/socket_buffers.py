"""A worker's registered pool buffers as the TCP wire sees them.

Host (CPU) buffers go over the socket directly: sends from memoryviews of the
pool, receives with `recv_into` straight into the destination bytes. Device
(CUDA) buffers cannot be handed to a socket, so their bytes pass through a few
reusable host staging chunks (pinned when CUDA is present): device -> chunk ->
socket on the sender, socket -> chunk -> device on the receiver.

    host buffer:    pool[off:off+n] ==sendall==> recv_into ==> pool[off:off+n]
    device buffer:  pool --copy--> chunk ==sendall==> recv_into chunk --copy--> pool
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

import torch

from kvcache.layout import Region
from transfer.flow import ByteBudget
from transfer.wire import recv_exact_into, send_bytes

CHUNK_BYTES = 8 << 20  # flow-control and staging granularity


def host_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a flat uint8 CPU tensor (no copy)."""
    return tensor.numpy().data.cast("B")


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

    async def send(
        self, sock: socket.socket, buffer: str, offset: int, length: int, budget: ByteBudget
    ) -> None:
        """Send `length` bytes at `offset` of `buffer`, one budgeted chunk at a time."""
        for start in range(offset, offset + length, CHUNK_BYTES):
            n = min(CHUNK_BYTES, offset + length - start)
            taken = await budget.acquire(n)
            try:
                view = self._views.get(buffer)
                if view is not None:
                    await send_bytes(sock, view[start : start + n])
                else:
                    await self._send_staged(sock, self._tensors[buffer][start : start + n])
            finally:
                await budget.release(taken)

    async def recv(self, sock: socket.socket, region: Region) -> None:
        """Receive exactly `region.length` bytes into `region`."""
        view = self._views.get(region.buffer)
        if view is not None:
            await recv_exact_into(sock, view[region.offset : region.end])
            return
        target = self._tensors[region.buffer]
        for start in range(region.offset, region.end, CHUNK_BYTES):
            n = min(CHUNK_BYTES, region.end - start)
            chunk = self._take_chunk()
            try:
                await recv_exact_into(sock, host_view(chunk)[:n])
                target[start : start + n].copy_(chunk[:n])
            finally:
                self._chunks.append(chunk)

    async def _send_staged(self, sock: socket.socket, source: torch.Tensor) -> None:
        chunk = self._take_chunk()
        try:
            n = source.numel()
            chunk[:n].copy_(source)  # synchronous: the bytes are on the host after this
            await send_bytes(sock, host_view(chunk)[:n])
        finally:
            self._chunks.append(chunk)

    def _take_chunk(self) -> torch.Tensor:
        if self._chunks:
            return self._chunks.pop()
        return torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
