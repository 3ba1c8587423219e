"""Raw limits the transfer benchmark compares against, measured in the same actors.

- raw TCP: one persistent loopback connection, blocking `sendall` of a
  memoryview and `recv_into` a preallocated buffer, no framing at all;
- raw NIXL: one READ of the whole size as a single descriptor between two
  agents created just for this (same progress-thread pacing);
- memcpy: `Tensor.copy_` of the same size inside one process.

Raw transfers use a scratch buffer as large as the pool, not the pool itself.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Any

import torch

from transfer.bench_worker import EndpointHost, EndpointSpec

_SIZE = struct.Struct(">Q")


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
        self._scratch_buffer: torch.Tensor | None = None

    def _scratch(self, name: str) -> torch.Tensor:
        """A buffer as large as the endpoint's whole pool, for raw transfers."""
        if self._scratch_buffer is None:
            size = sum(t.numel() for t in self.endpoints[name].tensors.buffers().values())
            self._scratch_buffer = torch.ones(size, dtype=torch.uint8)
        return self._scratch_buffer

    # ---------------------------------------------------------------- TCP

    def raw_tcp_listen(self, name: str) -> tuple[str, int]:
        """Serve `size`-byte requests from the pool buffer on a thread; returns the endpoint."""
        view = self._scratch(name).numpy().data.cast("B")
        listener = socket.create_server(("127.0.0.1", 0))
        self._listener = listener

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
        host, port = listener.getsockname()[:2]
        return host, port

    def raw_tcp_fetch(
        self, name: str, endpoint: tuple[str, int], size: int, reps: int
    ) -> list[float]:
        """Seconds per fetch of `size` bytes over one persistent connection."""
        view = self._scratch(name).numpy().data.cast("B")[:size]
        times = []
        with socket.create_connection(endpoint) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(reps):
                start = time.perf_counter()
                sock.sendall(_SIZE.pack(size))
                got = 0
                while got < size:
                    n = sock.recv_into(view[got:])
                    if n == 0:
                        raise ConnectionError("raw TCP server closed early")
                    got += n
                times.append(time.perf_counter() - start)
        return times

    # ---------------------------------------------------------------- NIXL

    def raw_nixl_init(self, name: str) -> tuple[bytes, int]:
        """A separate agent over the pool buffer; returns (metadata, buffer address)."""
        from transfer.nixl_transceiver import create_agent

        scratch = self._scratch(name)
        self._raw_agent = create_agent(f"raw-{id(self)}-{time.time_ns()}")
        self._raw_regs.append(self._raw_agent.register_memory([scratch]))
        return self._raw_agent.get_agent_metadata(), scratch.data_ptr()

    def raw_nixl_read(
        self, name: str, metadata: bytes, remote_addr: int, size: int, reps: int
    ) -> list[float]:
        """Seconds per single-descriptor READ of `size` bytes from the peer's raw agent."""
        agent = self._raw_agent
        peer = agent.add_remote_agent(metadata)
        local = agent.get_xfer_descs([(self._scratch(name).data_ptr(), size, 0)], "DRAM")
        remote = agent.get_xfer_descs([(remote_addr, size, 0)], "DRAM")
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            xfer = agent.initialize_xfer("READ", local, remote, peer)
            state = agent.transfer(xfer)
            while state == "PROC":
                state = agent.check_xfer_state(xfer)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL READ ended in {state}")
            times.append(time.perf_counter() - start)
            xfer.release()
        return times

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
        for reg in self._raw_regs:
            self._raw_agent.deregister_memory(reg)
        self._raw_regs.clear()
