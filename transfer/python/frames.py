"""The Python transceiver's protocol frames, over any `transfer.python.connection` wire.

Every message is a *header frame*, optionally followed by raw payload bytes
whose count the header declares:

    +----------------+---------------------------+---------------------+
    | u32 big-endian |  msgpack map, `len` bytes | payload (`n` bytes, |
    |      len       |  {"t": kind, ...}         |  only if declared)  |
    +----------------+---------------------------+---------------------+

Headers are small typed maps with one serializer (msgpack); tensor bytes never
pass through msgpack or pickle: they are sent from memoryviews of registered
buffers and received straight into destination memory.

A connection starts with a challenge/response handshake on a shared secret
(HMAC-SHA256 over a server nonce), so the secret never crosses the wire and a
peer without it is dropped before it can name a request.

Every function takes a `Connection` (TCP or UCX); a bare non-blocking socket
is taken as a TCP connection.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
from typing import Any

import msgpack

from transfer.errors import WireError
from transfer.python.connection import Connection, ConnectionClosed
from transfer.python.tcp_wire import FRAME_PREFIX, TcpConnection, tune_socket

__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "MAX_HEADER_BYTES",
    "PROTOCOL_VERSION",
    "ConnectionClosed",
    "client_handshake",
    "expect",
    "pack_header",
    "recv_header",
    "send_bytes",
    "send_header",
    "server_handshake",
    "tune_socket",
    "unpack_header",
]

# Headers carry region lists; 16 MiB covers ~500k segments, far above any request.
MAX_HEADER_BYTES = 16 << 20
_NONCE_BYTES = 32
# How long either side may take over the handshake once connected.
HANDSHAKE_TIMEOUT_S = 10.0
PROTOCOL_VERSION = 1

Link = Connection | socket.socket


def _connection(link: Link) -> Connection:
    return TcpConnection(link) if isinstance(link, socket.socket) else link


def pack_header(header: dict[str, Any]) -> bytes:
    """Encode one header frame (length prefix + msgpack map)."""
    body = msgpack.packb(header, use_bin_type=True)
    return FRAME_PREFIX.pack(len(body)) + body


def unpack_header(body: bytes) -> dict[str, Any]:
    """Decode a header body; raises `WireError` unless it is a map with a str `t`."""
    try:
        header = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireError(f"malformed header frame: {exc}") from exc
    if not isinstance(header, dict) or not isinstance(header.get("t"), str):
        raise WireError("malformed header frame: expected a map with a string field 't'")
    return header


async def send_bytes(link: Link, data: bytes | memoryview) -> None:
    """Send raw bytes; a memoryview is sent without copying."""
    await _connection(link).send(data)


async def send_header(link: Link, header: dict[str, Any]) -> None:
    await _connection(link).send_frame(pack_header(header))


async def recv_header(link: Link, max_bytes: int = MAX_HEADER_BYTES) -> dict[str, Any]:
    """Read one header frame; oversize or malformed frames raise `WireError`."""
    conn = _connection(link)
    length = await conn.recv_frame_length()
    if length > max_bytes:
        raise WireError(f"header frame of {length} bytes exceeds the limit of {max_bytes}")
    return unpack_header(await conn.recv_frame_body(length))


def expect(header: dict[str, Any], kind: str) -> dict[str, Any]:
    """Return `header` if its kind is `kind`; a peer-sent error becomes `WireError`."""
    if header["t"] == kind:
        return header
    if header["t"] == "error":
        raise WireError(f"peer refused: {header.get('message', '')}")
    raise WireError(f"expected a {kind!r} frame, got {header['t']!r}")


def _mac(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, nonce, hashlib.sha256).digest()


async def server_handshake(link: Link, secret: bytes) -> None:
    """Challenge a connecting peer; raises `WireError` if it lacks the secret."""
    nonce = os.urandom(_NONCE_BYTES)
    await send_header(link, {"t": "challenge", "v": PROTOCOL_VERSION, "nonce": nonce})
    reply = expect(await recv_header(link, max_bytes=1024), "auth")
    mac = reply.get("mac")
    if not isinstance(mac, bytes) or not hmac.compare_digest(mac, _mac(secret, nonce)):
        await send_header(link, {"t": "error", "message": "shared secret rejected"})
        raise WireError("peer failed the shared-secret handshake")
    await send_header(link, {"t": "welcome"})


async def client_handshake(link: Link, secret: bytes) -> None:
    """Answer the server's challenge; raises `WireError` if the server refuses."""
    challenge = expect(await recv_header(link, max_bytes=1024), "challenge")
    if challenge.get("v") != PROTOCOL_VERSION:
        raise WireError(
            f"peer speaks wire protocol {challenge.get('v')}, this side {PROTOCOL_VERSION}; "
            f"run the same version of the project on every worker"
        )
    nonce = challenge.get("nonce")
    if not isinstance(nonce, bytes):
        raise WireError("malformed challenge frame: nonce is not bytes")
    await send_header(link, {"t": "auth", "mac": _mac(secret, nonce)})
    expect(await recv_header(link, max_bytes=1024), "welcome")
