"""Errors a cache transfer can end with.

Every message names what a user can act on: the request, the peer, the
setting to change (`cache_transceiver.timeout_s`, `cache_transceiver.lease_s`)
or the layout fields that differ.
"""

from __future__ import annotations


class TransferError(RuntimeError):
    """Base class: a cache transfer did not complete; nothing was admitted."""


class TransferTimeout(TransferError):
    """The transfer did not finish within `cache_transceiver.timeout_s`."""

    def __init__(self, request_id: str, peer: str, timeout_s: float) -> None:
        super().__init__(
            f"transfer of request {request_id!r} from {peer} did not finish within "
            f"{timeout_s:g} s; raise cache_transceiver.timeout_s if the link is slow, "
            f"or check that {peer} is alive and reachable"
        )
        self.request_id = request_id
        self.peer = peer
        self.timeout_s = timeout_s


class LayoutMismatch(TransferError):
    """The two sides lay their caches out differently; no byte was moved."""

    def __init__(self, request_id: str, fields: list[str], detail: str = "") -> None:
        names = ", ".join(fields) if fields else "(unknown)"
        super().__init__(
            f"cache layout of request {request_id!r} differs between context and "
            f"generation side in: {names}{'; ' + detail if detail else ''}. "
            f"Give both sides the same model and kv_cache settings (the NIXL backend "
            f"also needs the same kv_cache.manager on every instance)"
        )
        self.request_id = request_id
        self.fields = list(fields)


class PeerGone(TransferError):
    """The other side vanished (process died, connection reset or refused)."""

    def __init__(self, request_id: str, peer: str, reason: str) -> None:
        super().__init__(
            f"peer {peer} holding request {request_id!r} is gone ({reason}); the "
            f"request's cache is lost, re-run its prefill on a live context worker"
        )
        self.request_id = request_id
        self.peer = peer


class TransferAborted(TransferError):
    """The request was aborted (on this side or by the holder) before it moved."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"transfer of request {request_id!r} was aborted: {reason}")
        self.request_id = request_id


class UnknownRequest(TransferError):
    """The holder has no published cache for this request (released or expired)."""

    def __init__(self, request_id: str, peer: str) -> None:
        super().__init__(
            f"{peer} holds no cache for request {request_id!r}: it was released, "
            f"aborted or its lease expired; raise cache_transceiver.lease_s if "
            f"generation workers pick up requests late"
        )
        self.request_id = request_id
        self.peer = peer


class WireError(TransferError):
    """A peer broke the wire protocol (bad secret, malformed or oversize frame)."""
