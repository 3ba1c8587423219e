"""Framing of the Python transceiver's TCP wire.

Every message is a *header frame*, optionally followed by raw payload bytes
whose count the header declares:

    +----------------+---------------------------+---------------------+
    | u32 big-endian |  msgpack map, `len` bytes | payload (`n` bytes, |
    |      len       |  {"t": kind, ...}         |  only if declared)  |
    +----------------+---------------------------+---------------------+

Headers are small typed maps with one serializer (msgpack); tensor bytes never
pass through msgpack or pickle: they are sent from memoryviews of registered
buffers and received with `recv_into` straight into destination memory.

A connection starts with a challenge/response handshake on a shared secret
(HMAC-SHA256 over a server nonce), so the secret never crosses the wire and a
peer without it is dropped before it can name a request.

All functions work on non-blocking sockets through the running event loop's
`sock_*` methods, which (unlike stream transports on Python 3.11) never copy
the data being sent into an intermediate buffer.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import socket
import struct
from typing import Any

import msgpack

from transfer.errors import WireError

_LEN = struct.Struct(">I")
# Headers carry region lists; 16 MiB covers ~500k segments, far above any request.
MAX_HEADER_BYTES = 16 << 20
_NONCE_BYTES = 32
PROTOCOL_VERSION = 1


class ConnectionClosed(ConnectionError):
    """The peer closed the connection (EOF) before a frame was complete."""


def pack_header(header: dict[str, Any]) -> bytes:
    """Encode one header frame (length prefix + msgpack map)."""
    body = msgpack.packb(header, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def unpack_header(body: bytes) -> dict[str, Any]:
    """Decode a header body; raises `WireError` unless it is a map with a str `t`."""
    try:
        header = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireError(f"malformed header frame: {exc}") from exc
    if not isinstance(header, dict) or not isinstance(header.get("t"), str):
        raise WireError("malformed header frame: expected a map with a string field 't'")
    return header


async def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` completely from `sock`; raises `ConnectionClosed` on EOF."""
    loop = asyncio.get_running_loop()
    got = 0
    total = len(view)
    while got < total:
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise ConnectionClosed(f"peer closed the connection after {got} of {total} bytes")
        got += n


async def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    await recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


async def send_bytes(sock: socket.socket, data: bytes | memoryview) -> None:
    """Send all of `data`; a memoryview is sent without copying."""
    await asyncio.get_running_loop().sock_sendall(sock, data)


async def send_header(sock: socket.socket, header: dict[str, Any]) -> None:
    await send_bytes(sock, pack_header(header))


async def recv_header(sock: socket.socket, max_bytes: int = MAX_HEADER_BYTES) -> dict[str, Any]:
    """Read one header frame; oversize or malformed frames raise `WireError`."""
    (length,) = _LEN.unpack(await recv_exact(sock, _LEN.size))
    if length > max_bytes:
        raise WireError(f"header frame of {length} bytes exceeds the limit of {max_bytes}")
    return unpack_header(await recv_exact(sock, length))


def expect(header: dict[str, Any], kind: str) -> dict[str, Any]:
    """Return `header` if its kind is `kind`; a peer-sent error becomes `WireError`."""
    if header["t"] == kind:
        return header
    if header["t"] == "error":
        raise WireError(f"peer refused: {header.get('message', '')}")
    raise WireError(f"expected a {kind!r} frame, got {header['t']!r}")


def _mac(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, nonce, hashlib.sha256).digest()


async def server_handshake(sock: socket.socket, secret: bytes) -> None:
    """Challenge a connecting peer; raises `WireError` if it lacks the secret."""
    nonce = os.urandom(_NONCE_BYTES)
    await send_header(sock, {"t": "challenge", "v": PROTOCOL_VERSION, "nonce": nonce})
    reply = expect(await recv_header(sock, max_bytes=1024), "auth")
    mac = reply.get("mac")
    if not isinstance(mac, bytes) or not hmac.compare_digest(mac, _mac(secret, nonce)):
        await send_header(sock, {"t": "error", "message": "shared secret rejected"})
        raise WireError("peer failed the shared-secret handshake")
    await send_header(sock, {"t": "welcome"})


async def client_handshake(sock: socket.socket, secret: bytes) -> None:
    """Answer the server's challenge; raises `WireError` if the server refuses."""
    challenge = expect(await recv_header(sock, max_bytes=1024), "challenge")
    if challenge.get("v") != PROTOCOL_VERSION:
        raise WireError(
            f"peer speaks wire protocol {challenge.get('v')}, this side {PROTOCOL_VERSION}; "
            f"run the same version of the project on every worker"
        )
    nonce = challenge.get("nonce")
    if not isinstance(nonce, bytes):
        raise WireError("malformed challenge frame: nonce is not bytes")
    await send_header(sock, {"t": "auth", "mac": _mac(secret, nonce)})
    expect(await recv_header(sock, max_bytes=1024), "welcome")


def tune_socket(sock: socket.socket) -> None:
    """Non-blocking with no Nagle delay; kernel buffer sizes stay auto-tuned
    (setting SO_RCVBUF would pin the window below what Linux grows it to)."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
