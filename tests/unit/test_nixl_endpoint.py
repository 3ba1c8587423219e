"""The NIXL endpoint's descriptor lists: each side's with its own memory type.

A recording stand-in for the agent sees what `prep_xfer_dlist` is asked for;
the real agent's DRAM path runs in `test_nixl_transceiver.py`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import transfer.nixl.endpoint as endpoint_module
from kvcache.layout import RequestRegions
from transfer.handle import BufferInfo, TransferHandle
from transfer.nixl.endpoint import NixlEndpoint


class RecordingAgent:
    """Answers the calls `NixlEndpoint` makes and records every prepared list."""

    def __init__(self) -> None:
        self.prepared: list[tuple[str, str, np.ndarray]] = []
        self.loaded: list[bytes] = []

    def register_memory(self, tensors: list[torch.Tensor]) -> object:
        return object()

    def get_agent_metadata(self) -> bytes:
        return b"local-metadata"

    def add_remote_agent(self, metadata: bytes) -> None:
        self.loaded.append(metadata)

    def prep_xfer_dlist(self, agent_name: str, entries: np.ndarray, mem_type: str) -> object:
        self.prepared.append((agent_name, mem_type, entries.copy()))
        return object()


def gpu_holder_handle(num_bytes: int) -> TransferHandle:
    """A handle of a holder whose pool lies on its GPU 1."""
    return TransferHandle(
        request_id="r1",
        transfer_id="t1",
        kind="nixl",
        regions=RequestRegions((), None, (), {}, (), (), 0, 0),
        signature={},
        agent_name="holder",
        agent_metadata=b"holder-metadata",
        buffers={"kv": BufferInfo(0x7F00_0000_0000, num_bytes, 1, "VRAM")},
    )


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch) -> RecordingAgent:
    recording = RecordingAgent()
    monkeypatch.setattr(endpoint_module, "create_agent", lambda name, delay: recording)
    return recording


def test_a_host_puller_prepares_its_lists_as_dram_and_a_gpu_holders_as_vram(
    agent: RecordingAgent,
) -> None:
    pool = torch.zeros(4096, dtype=torch.uint8)
    endpoint = NixlEndpoint({"kv": pool}, "puller", progress_delay_us=0)
    endpoint.start()
    assert endpoint.buffers["kv"] == BufferInfo(pool.data_ptr(), 4096, 0, "DRAM")
    assert endpoint.local is not None
    endpoint.local.handle(("kv", 1024, 0))
    endpoint.remote_tables(gpu_holder_handle(8192)).handle(("kv", 1024, 0))

    (local_agent, local_type, local_rows), (peer, remote_type, remote_rows) = agent.prepared
    assert (local_agent, local_type) == ("NIXL_INIT_AGENT", "DRAM")
    assert (peer, remote_type) == ("holder", "VRAM")
    # Rows are (address, length, device id) of each side's own buffer.
    assert local_rows[:, 0].tolist() == [pool.data_ptr() + i * 1024 for i in range(4)]
    assert remote_rows[:, 0].tolist() == [0x7F00_0000_0000 + i * 1024 for i in range(8)]
    assert set(remote_rows[:, 2].tolist()) == {1}
    assert agent.loaded == [b"holder-metadata"]


def test_each_buffer_travels_with_its_memory_type() -> None:
    handle = gpu_holder_handle(8192)
    assert TransferHandle.from_bytes(handle.to_bytes()).buffers == handle.buffers
