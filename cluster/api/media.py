"""Images in chat requests: where they may come from, and how they are checked.

An `image_url` part's URL is one of

- `data:image/png;base64,...` (PNG, JPEG or WebP): always accepted;
- `file:///path`: only under `media.allowed_local_media_path` (off by default);
- `http(s)://...`: only with `media.allow_remote_urls` (off by default), fetched
  with a time limit and a size limit.

Every image is decoded with Pillow before any worker sees the request, so an
undecodable, oversized or unsupported image is a 400 that names the content
part (`messages[0].content[1]`), and the server goes on serving.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.api.api_errors import APIError
from cluster.config.schema import MediaConfig

if TYPE_CHECKING:
    from PIL import Image

IMAGE_FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}


@dataclass(frozen=True)
class LoadedImage:
    data: bytes  # the image file, as sent
    image: Image.Image  # decoded, RGB


async def load_image(url: str, config: MediaConfig, param: str) -> LoadedImage:
    """Read and decode the image an `image_url` part names; `APIError` 400
    naming `param` when it is refused or undecodable."""
    data = await _read(url, config, param)
    return LoadedImage(data, _decode(data, config, param))


async def _read(url: str, config: MediaConfig, param: str) -> bytes:
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_url(url, param)
    elif scheme == "file":
        data = _local_file(url, config, param)
    elif scheme in ("http", "https"):
        data = await _remote(url, config, param)
    else:
        raise _refused(param, "the URL must be a data:, file:// or http(s):// URL")
    if len(data) > config.max_image_bytes:
        raise _refused(
            param, f"the image is {len(data)} bytes; at most {config.max_image_bytes} are allowed"
        )
    return data


def _data_url(url: str, param: str) -> bytes:
    header, sep, payload = url.partition(",")
    media_type = header.removeprefix("data:").split(";")[0].lower()
    if not sep or not header.endswith(";base64"):
        raise _refused(param, "a data: URL must be base64 (data:image/png;base64,...)")
    if media_type not in IMAGE_FORMATS.values():
        raise _refused(
            param, f"data: URL type {media_type!r}; send {', '.join(IMAGE_FORMATS.values())}"
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _refused(param, "the data: URL is not valid base64") from None


def _local_file(url: str, config: MediaConfig, param: str) -> bytes:
    if config.allowed_local_media_path is None:
        raise _refused(
            param, "file:// URLs are off; set media.allowed_local_media_path to allow a folder"
        )
    root = Path(config.allowed_local_media_path).resolve()
    path = Path(urllib.parse.unquote(urllib.parse.urlparse(url).path)).resolve()
    if not path.is_relative_to(root):
        raise _refused(param, f"file:// URLs must name a file under {root}")
    if not path.is_file():
        raise _refused(param, f"no file at {path}")
    if path.stat().st_size > config.max_image_bytes:
        raise _refused(param, f"the file is larger than {config.max_image_bytes} bytes")
    return path.read_bytes()


async def _remote(url: str, config: MediaConfig, param: str) -> bytes:
    if not config.allow_remote_urls:
        raise _refused(
            param, "http(s) image URLs are off; send a data: URL or set media.allow_remote_urls"
        )
    import httpx

    body = bytearray()
    try:
        async with (
            httpx.AsyncClient(timeout=config.remote_timeout_s) as client,
            client.stream("GET", url) as response,
        ):
            response.raise_for_status()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > config.max_image_bytes:
                    raise _refused(param, f"the image exceeds {config.max_image_bytes} bytes")
    except httpx.HTTPError as exc:
        raise _refused(param, f"fetching the image failed: {exc}") from exc
    return bytes(body)


def _decode(data: bytes, config: MediaConfig, param: str) -> Image.Image:
    from PIL import Image, UnidentifiedImageError

    from models.image_processing import to_rgb

    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format not in IMAGE_FORMATS:
                raise _refused(
                    param, f"{image.format} images are not supported; send PNG, JPEG or WebP"
                )
            width, height = image.size
            if width * height > config.max_image_pixels:
                raise _refused(
                    param,
                    f"the image is {width}x{height} pixels; "
                    f"at most {config.max_image_pixels} pixels are allowed",
                )
            image.load()
            return to_rgb(image)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise _refused(param, f"the image cannot be decoded ({exc})") from exc


def _refused(param: str, reason: str) -> APIError:
    return APIError(400, f"{param}: {reason}", param=param, code="invalid_image")
