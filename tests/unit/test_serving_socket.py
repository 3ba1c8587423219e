"""The HTTP listener: connections it accepts send small SSE chunks at once."""

from __future__ import annotations

import socket

from cluster.serving import _bind


def test_accepted_connections_have_nagle_off() -> None:
    listener = _bind("127.0.0.1", 0)
    try:
        listener.listen()
        with socket.create_connection(listener.getsockname()[:2]):
            accepted, _ = listener.accept()
            with accepted:
                # Nagle on, a second small chunk waits for a delayed ACK (up to 40 ms).
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        listener.close()
