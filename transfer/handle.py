"""A transfer handle: what a puller needs to read one request's published cache.

The holder's `Transceiver.publish` (or `offer`) returns one; it travels
through the router to the puller inside the context result. It names the
request and transfer, the holder's address (a Python endpoint, or a NIXL
agent with its metadata and registered buffers), the layout signature, and
where the cache lies (`RequestRegions`, carried as its block table and a
rule per layer). It is small and msgpack-serializable (`to_bytes`); a
handle's signature is compared with the puller's before any byte moves
(`check_signature`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from kvcache.layout import LayoutSignature, Region, RequestRegions, Strided
from transfer.errors import LayoutMismatch


def regions_to_dict(regions: RequestRegions) -> dict[str, Any]:
    """`RequestRegions` as plain msgpack-safe values: its block table, a few
    numbers per layer ([buffer, offset, stride, length] each) and the Mamba
    slot's regions ([buffer, offset, length]); never a region per segment."""
    return {
        "block_ids": list(regions.block_ids),
        "mamba_slot": regions.mamba_slot,
        "kv_layers": [list(layer) for layer in regions.kv_layers],
        "mamba": [
            [o, k, r.buffer, r.offset, r.length] for (o, k), r in regions.mamba_segments.items()
        ],
        "block_descriptors": [list(d) for d in regions.block_descriptors],
        "slot_descriptors": [list(r) for r in regions.slot_descriptors],
        "kv_head": [regions.kv_head_bytes, regions.kv_head_stride],
    }


def regions_from_dict(data: dict[str, Any]) -> RequestRegions:
    return RequestRegions(
        block_ids=tuple(data["block_ids"]),
        mamba_slot=data["mamba_slot"],
        kv_layers=tuple(Strided(*layer) for layer in data["kv_layers"]),
        mamba_segments={(o, k): Region(buf, off, n) for o, k, buf, off, n in data["mamba"]},
        block_descriptors=tuple(Strided(*d) for d in data["block_descriptors"]),
        slot_descriptors=tuple(Region(*r) for r in data["slot_descriptors"]),
        kv_head_bytes=data["kv_head"][0],
        kv_head_stride=data["kv_head"][1],
    )


@dataclass(frozen=True)
class BufferInfo:
    """A registered buffer as a remote peer sees it (NIXL addresses it directly).

    mem_type: where the bytes live, as NIXL names it: "DRAM" (host) or
        "VRAM" (a GPU). Each side's descriptors take their own buffer's type,
        so a host holder serves a GPU puller and the other way round.
    """

    address: int
    num_bytes: int
    device_id: int
    mem_type: str


@dataclass(frozen=True)
class TransferHandle:
    """Who holds a request's cache and where: everything a puller needs.

    kind: "python" or "nixl"; a handle is pulled by a transceiver of that kind.
    endpoint: (host, port) of the holder's listener (Python transceiver).
    wire: the transport that listener speaks, "tcp" or "ucx" (Python
        transceiver); the puller dials the holder over this wire.
    agent_name / agent_metadata: the holder's NIXL agent and its metadata blob.
    buffers: the holder's registered buffers (NIXL builds remote descriptors
        from them once per peer).

    The handle carries no lease expiry: clocks of two nodes need not agree,
    so only the holder decides, on its own monotonic clock, when a lease has
    run out, and a puller learns it from the holder.
    """

    request_id: str
    transfer_id: str
    kind: str
    regions: RequestRegions
    signature: dict[str, Any]
    endpoint: tuple[str, int] | None = None
    agent_name: str | None = None
    agent_metadata: bytes | None = None
    buffers: dict[str, BufferInfo] = field(default_factory=dict)
    wire: str = "tcp"

    @property
    def peer(self) -> str:
        """The holder, named for error messages."""
        if self.endpoint is not None:
            scheme = "" if self.wire == "tcp" else f"{self.wire}://"
            return f"{scheme}{self.endpoint[0]}:{self.endpoint[1]}"
        return f"NIXL agent {self.agent_name!r}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "transfer_id": self.transfer_id,
            "kind": self.kind,
            "regions": regions_to_dict(self.regions),
            "signature": self.signature,
            "endpoint": list(self.endpoint) if self.endpoint else None,
            "agent_name": self.agent_name,
            "agent_metadata": self.agent_metadata,
            "buffers": {
                k: [b.address, b.num_bytes, b.device_id, b.mem_type]
                for k, b in self.buffers.items()
            },
            "wire": self.wire,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransferHandle:
        endpoint = data["endpoint"]
        return cls(
            request_id=data["request_id"],
            transfer_id=data["transfer_id"],
            kind=data["kind"],
            regions=regions_from_dict(data["regions"]),
            signature=data["signature"],
            endpoint=(endpoint[0], endpoint[1]) if endpoint else None,
            agent_name=data["agent_name"],
            agent_metadata=data["agent_metadata"],
            buffers={k: BufferInfo(*v) for k, v in data["buffers"].items()},
            wire=data.get("wire", "tcp"),
        )

    def to_bytes(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> TransferHandle:
        return cls.from_dict(msgpack.unpackb(data, raw=False, strict_map_key=False))


def parse_signature(request_id: str, source: dict[str, Any]) -> LayoutSignature:
    """The holder's signature from a handle; `LayoutMismatch` if unreadable."""
    try:
        return LayoutSignature.from_dict(source)
    except (TypeError, ValueError) as exc:  # a holder running another version
        raise LayoutMismatch(request_id, ["signature"], f"unreadable signature: {exc}") from exc


def check_signature(
    request_id: str,
    source: LayoutSignature,
    dest: LayoutSignature,
    ignore: tuple[str, ...] = (),
) -> None:
    """Raise `LayoutMismatch` naming every differing field (except `ignore`)."""
    differing = source.diff(dest, ignore)
    if differing:
        raise LayoutMismatch(request_id, differing)
