"""How a worker's Python transceiver is secured: the cluster secret and its listen address.

The launcher draws one secret per deployment (`secrets.token_hex`) and hands
it, with the node's own IP, to every worker through `WorkerConfig`; the wire
level checks (handshake, oversize and malformed frames) are in test_wire.py.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch

from cluster.config.plan import InstancePlan
from cluster.config.schema import config_from_dict
from transfer.errors import WireError
from transfer.factory import create_transceiver
from transfer.python.frames import client_handshake, tune_socket

SECRET = "a3f1c2d4e5b6a7980112233445566778"


def _buffers() -> dict[str, torch.Tensor]:
    return {"kv": torch.zeros(4096, dtype=torch.uint8)}


def test_an_empty_cluster_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="cluster_secret is empty"):
        create_transceiver("python", _buffers(), secret=b"")


async def test_the_listener_binds_the_configured_node_address_only() -> None:
    xcvr = create_transceiver("python", _buffers(), secret=SECRET.encode(), host="127.0.0.1")
    await xcvr.start()
    try:
        host, port = xcvr.endpoint
        assert host == "127.0.0.1" and host != "0.0.0.0"
        # A peer with another secret is turned away at the handshake.
        sock = socket.socket()
        tune_socket(sock)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        with sock, pytest.raises(WireError, match="secret"):
            await client_handshake(sock, b"not-the-cluster-secret")
    finally:
        await xcvr.close()


def test_the_plan_passes_the_secret_and_node_ip_to_every_worker() -> None:
    config = _instance_plan().worker_config("ckpt", SECRET, "10.1.2.3")
    assert config.cluster_secret == SECRET and config.transfer_host == "10.1.2.3"


def _instance_plan() -> InstancePlan:
    settings = config_from_dict({"model": "unused"}).role_settings("context_servers")
    return InstancePlan(
        name="context-0",
        role="context",
        manager="v1",
        transceiver="python",
        block_size=settings.kv_cache.block_size,
        enable_block_reuse=False,
        max_tokens=256,
        kv_cache_memory_bytes=None,
        memory_fraction=None,
        num_blocks=16,
        num_tokens=256,
        num_mamba_slots=0,
        max_num_tokens=settings.max_num_tokens,
        max_batch_size=settings.max_batch_size,
        dtype=None,
        num_gpus=0.0,
        lease_s=60.0,
        transfer_timeout_s=30.0,
    )
