"""Content hashes of full KV blocks, chained from the first block of a sequence.

    h0 = H(root,  tokens[0:bs],   extra)
    h1 = H(h0,    tokens[bs:2bs], extra)          H = sha256 over a canonical encoding

A block's hash therefore names the whole prefix up to and including it, so two
requests share block `i` only if they agree on every token before it.

Tokens alone do not fix a block's KV when it holds image placeholders: every
image shows as the same `<image>` tokens. Each block therefore also hashes
the content hash of every image whose placeholders overlap it (`spans`), and
the chain carries that to every later block:

    block:    [ t t <image> <image> ] [ <image> t t t ] [ t t t t ]
    extra:      (image A)               (image A)         ()  <- still differs via h1 The hash
must be identical in every process and on every machine (a prefix-aware router
compares hashes reported by different workers), which rules out Python's
`hash()` (salted per process) and pickle (not canonical); the encoding below is
explicit bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Protocol

BlockHash = bytes

# Extra keys distinguish equal token blocks whose KV differs (e.g. an adapter
# name or a multimodal input digest); they are part of every block's hash.
ExtraKey = int | str | bytes
ExtraKeys = tuple[ExtraKey, ...]

_ROOT_TAG = b"disagg.kvcache.block-hash.v1"


class ContentSpan(Protocol):
    """Prompt positions whose KV depends on content beyond their token ids
    (an image's placeholders); `engine.multimodal.ImageInput` is one."""

    @property
    def content_hash(self) -> bytes: ...

    def overlaps(self, start: int, end: int) -> bool: ...


def span_keys(index: int, block_size: int, spans: Sequence[ContentSpan]) -> ExtraKeys:
    """Content hashes of the spans overlapping block `index`, in span order."""
    start = index * block_size
    return tuple(s.content_hash for s in spans if s.overlaps(start, start + block_size))


def cache_namespace(architecture: str, dtype: str) -> str:
    """The hash namespace of a model's cache: workers and the prefix-aware
    router must agree on it, so both derive it here."""
    return f"{architecture}:{dtype}"


def root_hash(namespace: str = "") -> BlockHash:
    """The parent hash of a sequence's first block.

    `namespace` separates caches that must never share blocks (a different
    model or dtype); workers serving the same model pass the same string.
    """
    return hashlib.sha256(_ROOT_TAG + b"\x00" + namespace.encode("utf-8")).digest()


def hash_block(
    parent: BlockHash, token_ids: Sequence[int], extra_keys: ExtraKeys = ()
) -> BlockHash:
    """Hash of one full block given its parent's hash."""
    digest = hashlib.sha256(parent)
    digest.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    digest.update(struct.pack("<I", len(extra_keys)))
    for key in extra_keys:
        digest.update(_encode_extra_key(key))
    return digest.digest()


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    parent: BlockHash,
    start_block: int = 0,
    extra_keys: ExtraKeys = (),
    spans: Sequence[ContentSpan] = (),
) -> list[BlockHash]:
    """Hashes of the full blocks `start_block, start_block + 1, ...` of `token_ids`.

    `parent` is the hash of block `start_block - 1` (or the root hash when
    `start_block == 0`). A trailing partial block is not hashed. `spans` add
    their content hash to the blocks they overlap.
    """
    hashes: list[BlockHash] = []
    for index in range(start_block, len(token_ids) // block_size):
        parent = hash_block(
            parent,
            token_ids[index * block_size : (index + 1) * block_size],
            extra_keys + span_keys(index, block_size, spans),
        )
        hashes.append(parent)
    return hashes


def hash_tail(
    anchor: BlockHash,
    index: int,
    block_size: int,
    tail: Sequence[int],
    spans: Sequence[ContentSpan] = (),
) -> BlockHash:
    """Hash of the partial block `index` holding `tail` (its first tokens),
    chained onto `anchor` (the hash of block `index - 1`, or the root): the
    key of a Mamba snapshot ending inside that block. Its images are those
    overlapping the tail itself. A full block's hash never equals it (the
    token count is hashed)."""
    start = index * block_size
    keys = tuple(s.content_hash for s in spans if s.overlaps(start, start + len(tail)))
    return hash_block(anchor, tail, keys)


def _encode_extra_key(key: ExtraKey) -> bytes:
    # A type tag and a length prefix keep ("ab",) and ("a", "b") apart.
    if isinstance(key, bool) or not isinstance(key, int | str | bytes):
        raise TypeError(
            f"block hash extra keys must be int, str or bytes, got {type(key).__name__}"
        )
    if isinstance(key, int):
        return b"i" + struct.pack("<q", key)
    raw = key.encode("utf-8") if isinstance(key, str) else key
    return (b"s" if isinstance(key, str) else b"b") + struct.pack("<I", len(raw)) + raw
