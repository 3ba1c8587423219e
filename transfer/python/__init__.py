"""The Python transceiver: msgpack header frames and raw bytes over a TCP or UCX wire."""
