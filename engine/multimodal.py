"""Images of a request, as the engine and the router see them (pure Python).

The HTTP edge decodes and validates each image once, picks its patch grid and
expands its placeholder in the prompt; what travels on is an `ImageInput`:
the image file's bytes as the client sent them (PNG, JPEG or WebP, small next
to decoded pixels), its content hash, its grid, and where its placeholder
tokens sit in the prompt:

    prompt:  ... <img> <image> x num_tokens </img> ...
                       ^ offset

Only context (and aggregated) workers receive the image bytes: they run the
vision encoder, whose output replaces the placeholders' embeddings during
prefill. A generation worker pulling a prefilled cache gets each image
`without_data()`: the content hash and span, which its block hashes need,
and no pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ImageInput:
    content_hash: bytes  # sha256 of the decoded RGB pixels and the patch grid
    data: bytes = b""  # the encoded image file
    grid_hw: tuple[int, int] = (0, 0)  # patches (rows, columns) after resizing
    offset: int = 0  # prompt position of the first placeholder token
    num_tokens: int = 0  # placeholder tokens (= embeddings) of this image

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    def without_data(self) -> ImageInput:
        """The same image with its bytes dropped (for a worker that only pulls)."""
        return replace(self, data=b"")

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any placeholder sits at a position in `[start, end)`."""
        return self.offset < end and start < self.end

    def __repr__(self) -> str:  # keep the image bytes out of logs
        return (
            f"ImageInput({self.content_hash.hex()[:12]}, grid={self.grid_hw}, "
            f"tokens=[{self.offset}, {self.end}))"
        )


@dataclass(frozen=True)
class EncoderCacheEvent:
    """An image's embeddings entered (`stored`) or left a worker's encoder
    cache. With these the prefix-aware router sends a repeated image to the
    worker that can skip its vision tower, with or without block reuse."""

    stored: bool
    content_hash: bytes
