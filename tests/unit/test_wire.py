"""The TCP wire: framing, the shared-secret handshake and protocol violations."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator

import msgpack
import pytest

from kvcache.factory import create_manager
from kvcache.spec import CacheSpec
from kvcache.tensors import allocate_cache_tensors
from transfer.errors import WireError
from transfer.handle import TransferHandle
from transfer.python.frames import (
    ConnectionClosed,
    client_handshake,
    pack_header,
    recv_header,
    send_bytes,
    send_header,
    server_handshake,
    tune_socket,
)
from transfer.python.transceiver import PythonTransceiver

SECRET = b"s3cret"
Holder = tuple[PythonTransceiver, TransferHandle, list[str]]
SPEC = CacheSpec(num_kv_heads=1, head_dim=4, attention_layers=(0,))


def socket_pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


async def test_header_round_trip() -> None:
    a, b = socket_pair()
    with a, b:
        await send_header(a, {"t": "seg", "i": 3, "n": 10, "blob": b"\x00\x01"})
        assert await recv_header(b) == {"t": "seg", "i": 3, "n": 10, "blob": b"\x00\x01"}


@pytest.mark.parametrize(
    "body", [b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"x": 1}), msgpack.packb({"t": 5})]
)
async def test_malformed_header_is_a_wire_error(body: bytes) -> None:
    a, b = socket_pair()
    with a, b:
        await send_bytes(a, struct.pack(">I", len(body)) + body)
        with pytest.raises(WireError, match="malformed"):
            await recv_header(b)


async def test_oversize_header_is_rejected_before_reading_it() -> None:
    a, b = socket_pair()
    with a, b:
        await send_bytes(a, struct.pack(">I", 1 << 30))
        with pytest.raises(WireError, match="exceeds the limit"):
            await recv_header(b, max_bytes=1 << 20)


async def test_handshake_accepts_the_secret_and_rejects_anything_else() -> None:
    a, b = socket_pair()
    with a, b:
        await asyncio.gather(server_handshake(a, SECRET), client_handshake(b, SECRET))
    a, b = socket_pair()
    with a, b:
        server, client = await asyncio.gather(
            server_handshake(a, SECRET), client_handshake(b, b"other"), return_exceptions=True
        )
        assert isinstance(server, WireError) and "secret" in str(server)
        assert isinstance(client, WireError) and "secret" in str(client)


async def test_eof_mid_frame_is_connection_closed() -> None:
    a, b = socket_pair()
    await send_bytes(a, struct.pack(">I", 100) + b"short")
    a.close()
    with b, pytest.raises(ConnectionClosed):
        await recv_header(b)


@pytest.fixture
async def holder() -> AsyncIterator[Holder]:
    manager = create_manager("v2", SPEC, 8, 4)
    tensors = allocate_cache_tensors(manager)
    xcvr = PythonTransceiver(tensors.buffers(), SECRET, max_header_bytes=4096)
    await xcvr.start()
    assert manager.allocate_slots("r1", 8)
    released: list[str] = []
    handle = xcvr.publish(
        "r1", manager.regions("r1"), manager.layout_signature(), 30, released.append
    )
    yield xcvr, handle, released
    await xcvr.close()


async def connect(endpoint: tuple[str, int], secret: bytes = SECRET) -> socket.socket:
    sock = socket.socket()
    tune_socket(sock)
    await asyncio.get_running_loop().sock_connect(sock, endpoint)
    await client_handshake(sock, secret)
    return sock


async def is_closed_by_peer(sock: socket.socket) -> bool:
    data = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 1), 5)
    return data == b""


async def test_wrong_secret_connection_is_dropped(holder: Holder) -> None:
    xcvr, handle, released = holder
    with pytest.raises(WireError, match="secret"):
        await connect(xcvr.endpoint, b"wrong")
    assert xcvr.num_pinned == 1 and released == []


async def test_oversize_frame_closes_connection(holder: Holder) -> None:
    xcvr, _, _ = holder
    sock = await connect(xcvr.endpoint)
    with sock:
        await send_bytes(sock, struct.pack(">I", 1 << 20))  # above the holder's 4096 limit
        assert await is_closed_by_peer(sock)


async def test_malformed_frame_closes_only_that_connection(holder: Holder) -> None:
    xcvr, handle, released = holder
    good = await connect(xcvr.endpoint)
    bad = await connect(xcvr.endpoint)
    with good, bad:
        await send_bytes(bad, struct.pack(">I", 3) + b"\xc1\xc1\xc1")
        assert await is_closed_by_peer(bad)
        # the other connection, opened before, still gets served
        rid, tid = handle.request_id, handle.transfer_id
        await send_header(good, {"t": "release", "rid": rid, "tid": tid})
        assert (await recv_header(good))["t"] == "released"
    assert released == ["r1"]


async def test_range_outside_the_request_is_refused(holder: Holder) -> None:
    xcvr, handle, released = holder
    sock = await connect(xcvr.endpoint)
    with sock:
        rid, tid = handle.request_id, handle.transfer_id
        block = handle.regions.descriptors[0]
        stolen = [["kv", 0, block.length]]  # block 0: not the request's
        await send_header(sock, {"t": "pull", "rid": rid, "tid": tid, "ranges": stolen})
        assert await is_closed_by_peer(sock)
    assert xcvr.num_pinned == 1 and released == []


async def test_segment_larger_than_declared_is_rejected_by_puller(holder: Holder) -> None:
    _, real, _ = holder
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)

    async def lying_holder() -> None:
        conn, _ = await asyncio.get_running_loop().sock_accept(listener)
        tune_socket(conn)
        with conn:
            await server_handshake(conn, SECRET)
            await recv_header(conn)
            await send_bytes(conn, pack_header({"t": "data", "n": 1 << 30}))
            await asyncio.sleep(1)

    server = asyncio.create_task(lying_holder())
    manager = create_manager("v2", SPEC, 8, 4)
    puller = PythonTransceiver(allocate_cache_tensors(manager).buffers(), SECRET)
    await puller.start()
    try:
        assert manager.allocate_for_transfer("r1", 8)
        handle = TransferHandle.from_dict({**real.to_dict(), "endpoint": listener.getsockname()})
        with pytest.raises(WireError, match="declared"):
            await puller.pull(handle, manager.regions("r1"), manager.layout_signature(), 5)
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        listener.close()
        await puller.close()
