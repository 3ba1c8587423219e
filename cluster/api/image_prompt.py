"""A chat request's images -> placeholder text in the prompt + `ImageInput`s.

Each image part is loaded and decoded (`cluster.api.media`), given the patch grid
the checkpoint's preprocessing picks, and stands in the rendered prompt as
`<img>` + `<image>` x num_tokens + `</img>`. After tokenization every run of
image tokens is matched to its image, in order, which fixes each image's
`offset`. The content hash covers the decoded pixels and the grid, so the
same picture sent as PNG or as WebP shares encoder-cache entries and blocks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cluster.api.api_errors import APIError
from cluster.api.media import MediaConfig, load_image
from cluster.api.protocol import ChatCompletionRequest
from engine.multimodal import ImageInput
from models.config import VisionConfig
from models.image_processing import ImageProcessorConfig, image_prompt_text


@dataclass(frozen=True)
class ImageSupport:
    """What the server needs to accept images for a VL checkpoint."""

    vision: VisionConfig
    processing: ImageProcessorConfig
    placeholder: str  # the text of the image token, e.g. "<image>"


@dataclass(frozen=True)
class ChatImages:
    texts: list[str]  # per image part, its placeholder text
    inputs: list[ImageInput]  # per image part, offset not yet known


async def load_chat_images(
    body: ChatCompletionRequest, support: ImageSupport | None, media: MediaConfig
) -> ChatImages:
    """Load, check and size every image part; `APIError` 400 naming the part."""
    parts = body.image_parts()
    if not parts:
        return ChatImages([], [])
    if support is None:
        raise APIError(
            400, f"{parts[0][0]}: this model takes no images", parts[0][0], "invalid_image"
        )
    if len(parts) > media.max_images_per_request:
        raise APIError(
            400,
            f"messages: {len(parts)} images; at most {media.max_images_per_request} per request",
            "messages",
            "invalid_image",
        )
    texts, inputs = [], []
    for param, part in parts:
        loaded = await load_image(part.image_url.url, media, param)
        width, height = loaded.image.size
        grid = support.processing.patch_grid(height, width, len(parts))
        num_tokens = support.processing.num_image_tokens(grid)
        digest = hashlib.sha256(b"%dx%d:%dx%d:" % (*grid, width, height))
        digest.update(loaded.image.tobytes())
        inputs.append(ImageInput(digest.digest(), loaded.data, grid, 0, num_tokens))
        texts.append(image_prompt_text(num_tokens, support.placeholder))
    return ChatImages(texts, inputs)


def place_images(
    prompt: Sequence[int], images: Sequence[ImageInput], image_token_id: int
) -> tuple[ImageInput, ...]:
    """Each image at the run of `image_token_id` tokens it stands for.

    Raises `APIError` 400 when the runs do not match the images one to one
    (the text itself held the image token).
    """
    runs: list[tuple[int, int]] = []
    for position, token in enumerate(prompt):
        if token != image_token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == position:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((position, 1))
    if [length for _, length in runs] != [image.num_tokens for image in images]:
        raise APIError(
            400,
            "messages: the text holds the image placeholder token; send images as image_url parts",
            "messages",
            "invalid_image",
        )
    return tuple(
        replace(image, offset=offset) for image, (offset, _) in zip(images, runs, strict=True)
    )


def refuse_completion_images(prompt: Sequence[int], support: ImageSupport | None) -> None:
    """`/v1/completions` takes no images: a prompt holding the image
    placeholder token (which only an image's embeddings may fill) is a 400
    that points at `/v1/chat/completions`."""
    if support is not None and support.vision.image_token_id in prompt:
        raise APIError(
            400,
            f"prompt: holds the image placeholder {support.placeholder!r}; /v1/completions "
            "takes text only: send images as image_url content parts to /v1/chat/completions",
            "prompt",
            "invalid_image",
        )
