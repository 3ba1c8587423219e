"""Raw limits the transfer benchmark compares against, measured in the same actors.

- raw TCP: one persistent loopback connection, blocking `sendall` of a
  memoryview and `recv_into` a preallocated buffer, no framing at all;
- raw NIXL: one READ of the whole size between two agents created just for
  this (same progress-thread pacing), one descriptor per pool buffer the size
  spans (one for V2's block-major pool, one per layer for V1);
- memcpy: `Tensor.copy_` of the same size inside one process.

Why the raw NIXL READ runs over the pools themselves, not a scratch buffer:
on this kind of machine the speed of a large copy depends on which physical
pages back the buffers, not only on how many bytes move. Interleaved
measurements in one run put a 64 MiB READ between two freshly allocated
scratch buffers at 9.5 ms median and the same READ, same agents, one
descriptor, between the two workers' pool buffers at 15.4 ms (pages of both
touched beforehand, no page faults during either). A baseline over other
memory therefore measures the allocation, not the transceiver. So the raw
READ moves the same bytes as the transceiver between the same registered
pool buffers: source at the holder's first blocks, destination advancing
through the puller's pool by one request per repetition, as the FIFO block
allocator hands the transceiver different blocks on every pull. What is left
between the two is the transceiver's own work: one descriptor per block, the
agent thread, signature and lease checks. NIXL merges descriptors only where
both sides are contiguous, and blocks freed tail first come back from the
FIFO queue in descending order: in this benchmark's sequence a 64 MiB V1
pull is 820 separate copies of 64 KiB (of its 1024 descriptors), 256 MiB is
2472 of 4096 (V2: 205 of 256 and 618 of 1024). Handed out in ascending id
order, the same pulls would be 8 and 12 copies (V2: 2 and 3).

Raw TCP and memcpy still use a scratch buffer as large as the pool, allocated
as the pools are.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Any

import torch

from benchmarks.transfer.endpoints import EndpointHost, EndpointSpec
from kvcache.tensors import allocate_host_buffer

_SIZE = struct.Struct(">Q")
_PAGE = 4096


def serve_raw_tcp(view: memoryview) -> socket.socket:
    """A loopback listener that answers each request (an 8-byte size) with that
    many bytes of `view`, on a daemon thread, until it is closed."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # listener closed
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while header := conn.recv(_SIZE.size, socket.MSG_WAITALL):
                    (size,) = _SIZE.unpack(header)
                    conn.sendall(view[:size])

    threading.Thread(target=serve, daemon=True).start()
    return listener


def connect_raw_tcp(endpoint: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(endpoint)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def fetch_raw_tcp(sock: socket.socket, view: memoryview) -> tuple[float, float]:
    """Fill `view` from a `serve_raw_tcp` listener: (seconds, this process's CPU seconds)."""
    start, cpu = time.perf_counter(), time.process_time()
    sock.sendall(_SIZE.pack(len(view)))
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("raw TCP server closed early")
        got += n
    return time.perf_counter() - start, time.process_time() - cpu


class BenchHost(EndpointHost):
    """An endpoint host that can also measure raw transports over its pool memory."""

    def __init__(self, specs: dict[str, EndpointSpec]) -> None:
        super().__init__(specs)
        # Fault every pool page in now, as the raw scratch buffers are, so first
        # touches of fresh blocks do not count against the transceivers.
        for endpoint in self.endpoints.values():
            for buffer in endpoint.tensors.buffers().values():
                buffer.fill_(0)
        self._listener: socket.socket | None = None
        self._raw_agent: Any = None
        self._raw_regs: list[Any] = []
        self._raw_socks: dict[tuple[str, int], socket.socket] = {}
        self._raw_peers: dict[bytes, str] = {}
        self._raw_reads = 0  # READs so far; each lands one request further into the pool
        self._scratch_buffer: torch.Tensor | None = None

    def _scratch(self, name: str) -> torch.Tensor:
        """A buffer as large as the host's pools together, for raw transfers."""
        if self._scratch_buffer is None:
            # All endpoints' pools: the ranks of a tensor-parallel holder
            # together hold a whole request.
            size = sum(
                t.numel()
                for endpoint in self.endpoints.values()
                for t in endpoint.tensors.buffers().values()
            )
            # Pages of the same kind as the pools' (`allocate_host_buffer`).
            self._scratch_buffer = allocate_host_buffer(size).fill_(1)
        return self._scratch_buffer

    # ---------------------------------------------------------------- TCP

    def raw_tcp_listen(self, name: str) -> tuple[str, int]:
        """Serve `size`-byte requests from the pool buffer on a thread; returns the endpoint."""
        self._listener = serve_raw_tcp(self._scratch(name).numpy().data.cast("B"))
        host, port = self._listener.getsockname()[:2]
        return host, port

    def raw_tcp_fetch(
        self, name: str, endpoint: tuple[str, int], size: int, reps: int
    ) -> list[tuple[float, float]]:
        """(seconds, this process's CPU seconds) per fetch of `size` bytes over
        one persistent connection."""
        view = self._scratch(name).numpy().data.cast("B")[:size]
        # One connection kept across calls, as the transceiver keeps its own.
        sock = self._raw_socks.get(endpoint)
        if sock is None:
            sock = connect_raw_tcp(endpoint)
            self._raw_socks[endpoint] = sock
        return [fetch_raw_tcp(sock, view) for _ in range(reps)]

    # ---------------------------------------------------------------- NIXL

    def raw_nixl_init(self, name: str) -> tuple[bytes, dict[str, int]]:
        """A separate agent over the endpoint's pool buffers; returns (metadata, buffer addresses)."""
        from transfer.nixl.transceiver import create_agent

        self._raw_agent = create_agent(f"raw-{id(self)}-{time.time_ns()}")
        buffers = self.endpoints[name].tensors.buffers()
        for tensor in buffers.values():
            self._raw_regs.append(self._raw_agent.register_memory([tensor]))
        return self._raw_agent.get_agent_metadata(), {n: t.data_ptr() for n, t in buffers.items()}

    def raw_nixl_read(
        self,
        name: str,
        metadata: bytes,
        remote: dict[str, int],
        size: int,
        reps: int,
        run: int = 0,
    ) -> list[tuple[float, float]]:
        """(seconds, this process's CPU seconds) per READ of `size` bytes of KV
        from the peer's pools into this one's.

        One descriptor per pool buffer the bytes span, or with `run` one per
        `run` bytes of it (the READ of a head-slice row's descriptor count);
        the destination moves on by one request per READ, across calls (see
        the module docstring).
        """
        agent = self._raw_agent
        # The peer is added once and kept across calls, as the transceiver
        # keeps its peers: a first READ to a new peer also sets up UCX.
        peer = self._raw_peers.get(metadata)
        if peer is None:
            peer = self._raw_peers[metadata] = agent.add_remote_agent(metadata)
        buffers = self.endpoints[name].tensors.buffers()
        spans = self._kv_spans(name, size)
        times = []
        for _ in range(reps):
            self._raw_reads += 1
            local, far = [], []
            for buffer, (offset, length) in spans.items():
                room = buffers[buffer].numel() - offset - length
                shift = self._raw_reads * length % (room + 1) if room > 0 else 0
                shift -= shift % _PAGE
                step = run or length
                for at in range(0, length, step):
                    piece = min(step, length - at)
                    local.append((buffers[buffer].data_ptr() + offset + shift + at, piece, 0))
                    far.append((remote[buffer] + offset + at, piece, 0))
            local_descs = agent.get_xfer_descs(local, "DRAM")
            far_descs = agent.get_xfer_descs(far, "DRAM")
            start, cpu = time.perf_counter(), time.process_time()
            xfer = agent.initialize_xfer("READ", local_descs, far_descs, peer)
            state = agent.transfer(xfer)
            while state == "PROC":
                state = agent.check_xfer_state(xfer)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL READ ended in {state}")
            times.append((time.perf_counter() - start, time.process_time() - cpu))
            xfer.release()
        return times

    def _kv_spans(self, name: str, size: int) -> dict[str, tuple[int, int]]:
        """buffer -> (offset, length): where `size` bytes of whole blocks from block 1 lie.

        Block 0 is the pool's null block, never handed out, so a request's
        blocks start at 1 in a fresh pool.
        """
        layout = self.endpoints[name].manager.layout
        block_bytes = sum(r.length for r in layout.descriptors([1], None))
        num_blocks = max(1, size // block_bytes)
        spans: dict[str, tuple[int, int]] = {}
        for region in layout.descriptors(range(1, num_blocks + 1), None):
            offset, length = spans.get(region.buffer, (region.offset, 0))
            spans[region.buffer] = (min(offset, region.offset), length + region.length)
        return spans

    # ---------------------------------------------------------------- memcpy

    def memcpy(self, name: str, size: int, reps: int) -> list[float]:
        src = self._scratch(name)[:size]
        dst = torch.empty_like(src)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        return times

    def close_raw(self) -> None:
        if self._listener is not None:
            self._listener.close()
        for sock in self._raw_socks.values():
            sock.close()
        self._raw_socks.clear()
        for peer in self._raw_peers.values():
            self._raw_agent.remove_remote_agent(peer)
        self._raw_peers.clear()
        for reg in self._raw_regs:
            self._raw_agent.deregister_memory(reg)
        self._raw_regs.clear()
