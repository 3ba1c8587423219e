"""This worker's end of NIXL: its agent, registered pool and the remote agents it loaded.

Both sides of `NixlTransceiver` share one `NixlEndpoint`. Every call on the
agent runs on the endpoint's `AgentThread`s, never on the event loop (see
`transfer.nixl.agent`): `thread` owns the agent from `start` to `close`, and
the `post_threads` after it only post READs and release them; the peer maps
and prepared tables they share are locked. A peer is loaded once, as a
holder this worker READs from (with descriptor tables prepared once per
buffer) or as a puller whose claims it answers, and loaded again when it
comes back with new metadata (it was restarted).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from transfer.errors import PeerGone
from transfer.handle import BufferInfo, TransferHandle
from transfer.nixl.agent import POST_LANES, AgentThread, create_agent
from transfer.nixl.descriptors import Prepare, PreparedTables

_LOCAL_AGENT = "NIXL_INIT_AGENT"


class NixlEndpoint:
    """The agent of one worker over its pool buffers (flat uint8 tensors,
    registered once, each as DRAM or VRAM by its device). `agent` is None until `start` and after
    `close`; every method but the constructor runs on `thread`, and
    `remote_tables` also on a post thread."""

    def __init__(
        self, buffers: Mapping[str, torch.Tensor], name: str, progress_delay_us: int
    ) -> None:
        self.name = name
        self.thread = AgentThread(f"nixl-{name}")
        # Threads that post READs: `thread` first, then ones that only post
        # (and release what they posted); see `transfer.nixl.agent`.
        self.post_threads = [self.thread] + [
            AgentThread(f"nixl-{name}-post{i}") for i in range(1, POST_LANES)
        ]
        # Guards the peer maps, which a post on another thread also reads.
        self._peers_lock = threading.RLock()
        self._tensors = dict(buffers)
        self._progress_delay_us = progress_delay_us
        self.buffers = {n: _buffer_info(t) for n, t in self._tensors.items()}
        self.sizes = {n: b.num_bytes for n, b in self.buffers.items()}
        self.agent: Any = None
        self.metadata = b""
        self._registered: list[Any] = []
        self.local: PreparedTables | None = None
        self.remote: dict[str, PreparedTables] = {}  # holders we READ from
        self._remote_metadata: dict[str, bytes] = {}
        self._claimants: dict[str, bytes] = {}  # pullers loaded to answer their claims

    def start(self) -> None:
        self.agent = create_agent(self.name, self._progress_delay_us)
        for tensor in self._tensors.values():
            self._registered.append(self.agent.register_memory([tensor]))
        self.metadata = self.agent.get_agent_metadata()
        self.local = PreparedTables(self.buffers, self._prepare(_LOCAL_AGENT))

    def close(self) -> None:
        for tables in [self.local, *self.remote.values()]:
            if tables is not None:
                tables.release()
        for peer in list(self.remote):
            self.forget(peer)
        for puller in self._claimants:
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(puller)
        self._claimants.clear()
        for reg in self._registered:
            self.agent.deregister_memory(reg)
        self._registered.clear()
        self.agent = None

    def remote_tables(self, handle: TransferHandle) -> PreparedTables:
        """The holder's prepared tables, loading it first (again, if it restarted)."""
        with self._peers_lock:
            return self._remote_tables(handle)

    def _remote_tables(self, handle: TransferHandle) -> PreparedTables:
        peer, metadata = handle.agent_name, handle.agent_metadata
        assert peer is not None and metadata is not None  # checked by check_layout
        tables = self.remote.get(peer)
        if tables is not None and self._remote_metadata.get(peer) != metadata:
            # The same agent name with new metadata: the holder was restarted.
            self.forget(peer)
            tables = None
        if tables is None:
            try:
                self.agent.add_remote_agent(metadata)
            except Exception as exc:
                raise PeerGone(handle.request_id, handle.peer, f"bad metadata: {exc}") from exc
            tables = PreparedTables(handle.buffers, self._prepare(peer))
            self.remote[peer] = tables
            self._remote_metadata[peer] = metadata
        return tables

    def forget(self, peer: str) -> None:
        """Drop a peer's prepared lists and metadata (it died or we are closing)."""
        with self._peers_lock:
            tables = self.remote.pop(peer, None)
            self._remote_metadata.pop(peer, None)
        if tables is not None:
            with contextlib.suppress(Exception):
                tables.release()
        with contextlib.suppress(Exception):
            self.agent.remove_remote_agent(peer)

    def load_claimant(self, puller: str, metadata: bytes) -> None:
        """Load a puller so its claim can be answered, unless it is loaded
        already (as a holder, or as a claimant with this metadata)."""
        if puller not in self.remote and self._claimants.get(puller) != metadata:
            if puller in self._claimants:
                self.agent.remove_remote_agent(puller)
            self.agent.add_remote_agent(metadata)
            self._claimants[puller] = metadata

    def drop_claimant(self, puller: str) -> None:
        """Forget a puller that could not be answered (it died)."""
        self._claimants.pop(puller, None)

    def _prepare(self, agent_name: str) -> Prepare:
        def prepare(entries: np.ndarray, mem_type: str) -> object:
            return self.agent.prep_xfer_dlist(agent_name, entries, mem_type)

        return prepare


def _buffer_info(tensor: torch.Tensor) -> BufferInfo:
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError("NIXL buffers must be flat contiguous uint8 tensors")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"NIXL registers host or CUDA memory, not {tensor.device.type}")
    mem_type = "VRAM" if tensor.device.type == "cuda" else "DRAM"
    return BufferInfo(tensor.data_ptr(), tensor.numel(), max(tensor.get_device(), 0), mem_type)
