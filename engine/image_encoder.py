"""Image embeddings for the prefill steps of a VL model, with an encoder cache.

The model runner asks, per step, for the embedding rows of every image
placeholder its chunks cover; a chunk may hold part of an image (chunked
prefill), so an image is encoded once, on the first chunk that reaches it,
and its embeddings are kept in an LRU cache keyed by the image's content
hash. The same image in a later request (or the rest of it in the next
chunk) skips decoding, preprocessing and the vision tower.
"""

from __future__ import annotations

import io
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from engine.multimodal import EncoderCacheEvent, ImageInput
from models.image_processing import ImageProcessorConfig, preprocess_image

# Embeddings kept for reuse; an entry is num_tokens x hidden_size values.
DEFAULT_CACHE_BYTES = 256 << 20
# Cache events kept for the router between its polls; older ones are dropped
# when nobody drains them.
_MAX_PENDING_EVENTS = 4096


@runtime_checkable
class VisionModel(Protocol):
    def encode_image(
        self, pixel_values: torch.Tensor, grid_hw: tuple[int, int]
    ) -> torch.Tensor: ...


@dataclass
class EncoderStats:
    hits: int = 0  # images served from the cache
    misses: int = 0  # images run through the vision tower


@dataclass(frozen=True)
class ImageChunk:
    """The part of one sequence's step that may cover image placeholders."""

    images: Sequence[ImageInput]
    start: int  # first prompt position of the chunk
    end: int  # one past its last position
    first_row: int  # row of `start` in the step's flattened tokens


def placeholder_rows(chunks: Sequence[ImageChunk]) -> list[int]:
    """The step rows the chunks' image placeholders take, from the host counts
    alone (ranks of a tensor-parallel instance learn them without a read of
    the device tensor `ImageEncoder.rows` builds)."""
    return [
        chunk.first_row + position - chunk.start
        for chunk in chunks
        for image, lo, hi in _covered([chunk])
        for position in range(lo, hi)
    ]


def _covered(chunks: Sequence[ImageChunk]) -> list[tuple[ImageInput, int, int]]:
    """Each image a chunk reaches, with the positions `[lo, hi)` of it the chunk holds."""
    covered = []
    for chunk in chunks:
        for image in chunk.images:
            lo, hi = max(image.offset, chunk.start), min(image.end, chunk.end)
            if lo < hi:
                covered.append((image, lo, hi))
    return covered


class ImageEncoder:
    def __init__(
        self,
        model: VisionModel,
        processing: ImageProcessorConfig,
        device: torch.device,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self.model = model
        self.processing = processing
        self.device = device
        self.cache_bytes = cache_bytes
        self.stats = EncoderStats()
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._cached_bytes = 0
        self._events: deque[EncoderCacheEvent] = deque(maxlen=_MAX_PENDING_EVENTS)

    def rows(self, chunks: Sequence[ImageChunk]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(rows [M], embeddings [M, hidden])` of the placeholders the chunks
        cover (rows in `placeholder_rows` order), or None when they cover none."""
        rows = placeholder_rows(chunks)
        if not rows:
            return None
        parts = [
            self.embeddings(image)[lo - image.offset : hi - image.offset]
            for image, lo, hi in _covered(chunks)
        ]
        return torch.tensor(rows, dtype=torch.int64, device=self.device), torch.cat(parts)

    def embeddings(self, image: ImageInput) -> torch.Tensor:
        """`[image.num_tokens, hidden]`, from the cache or the vision tower."""
        cached = self._cache.get(image.content_hash)
        if cached is not None:
            self._cache.move_to_end(image.content_hash)
            self.stats.hits += 1
            return cached
        self.stats.misses += 1
        embeds = self._encode(image)
        if embeds.shape[0] != image.num_tokens:
            raise ValueError(
                f"image {image.content_hash.hex()[:12]} gives {embeds.shape[0]} embeddings "
                f"for {image.num_tokens} placeholder tokens"
            )
        self._remember(image.content_hash, embeds)
        return embeds

    def _encode(self, image: ImageInput) -> torch.Tensor:
        from PIL import Image

        if not image.data:
            raise ValueError(
                f"image {image.content_hash.hex()[:12]} was prefilled on a context worker; "
                "its pixels are not here to compute its placeholders again"
            )
        with Image.open(io.BytesIO(image.data)) as decoded:
            pixels = preprocess_image(decoded, image.grid_hw, self.processing)
        # One tower pass per encoder grid: the whole image, or each of its tiles.
        grids = self.processing.encoder_grids(image.grid_hw)
        pieces = pixels.to(self.device).split([rows * cols for rows, cols in grids])
        with torch.inference_mode():
            return torch.cat(
                [
                    self.model.encode_image(piece, grid)
                    for piece, grid in zip(pieces, grids, strict=True)
                ]
            )

    def _remember(self, key: bytes, embeds: torch.Tensor) -> None:
        size = embeds.numel() * embeds.element_size()
        if size > self.cache_bytes:
            return
        self._cache[key] = embeds
        self._cached_bytes += size
        self._events.append(EncoderCacheEvent(True, key))
        while self._cached_bytes > self.cache_bytes:
            evicted_key, evicted = self._cache.popitem(last=False)
            self._cached_bytes -= evicted.numel() * evicted.element_size()
            self._events.append(EncoderCacheEvent(False, evicted_key))

    def drain_events(self) -> list[EncoderCacheEvent]:
        """Images stored in and evicted from the cache since the last call,
        oldest first. Safe while the step thread keeps encoding: each event is
        taken off the deque singly, so none is lost between copy and clear."""
        events = []
        while self._events:
            events.append(self._events.popleft())
        return events
