"""Image parts at the HTTP edge: where they may come from, how bad ones are refused,
and how they become placeholder tokens (cluster.api.media, cluster.api.image_prompt)."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from pydantic import ValidationError

from cluster.api.api_errors import APIError, validation_error
from cluster.api.image_prompt import ImageSupport, load_chat_images, place_images
from cluster.api.media import load_image
from cluster.api.protocol import ChatCompletionRequest
from cluster.config.schema import MediaConfig
from models.embedded.configs import checkpoint_config
from models.hf_config import parse_model_config
from models.image_processing import ImageProcessorConfig

PARAM = "messages[0].content[1]"


def encoded(fmt: str = "PNG", size: tuple[int, int] = (40, 30), colour: int = 90) -> bytes:
    buffer = io.BytesIO()
    options = {"lossless": True} if fmt == "WEBP" else {}
    Image.new("RGB", size, (colour, 20, 200)).save(buffer, format=fmt, **options)
    return buffer.getvalue()


def data_url(raw: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(raw).decode()


def load(url: str, config: MediaConfig | None = None) -> Any:
    return asyncio.run(load_image(url, config or MediaConfig(), PARAM))


def refusal(url: str, config: MediaConfig | None = None) -> APIError:
    with pytest.raises(APIError) as info:
        load(url, config)
    assert info.value.status == 400 and info.value.param == PARAM
    assert info.value.message.startswith(PARAM)
    return info.value


@pytest.mark.parametrize(
    ("fmt", "media_type"), [("PNG", "png"), ("JPEG", "jpeg"), ("WEBP", "webp")]
)
def test_data_urls_of_each_format_decode_to_rgb(fmt: str, media_type: str) -> None:
    raw = encoded(fmt)
    loaded = load(data_url(raw, f"image/{media_type}"))
    assert loaded.data == raw and loaded.image.mode == "RGB" and loaded.image.size == (40, 30)


def test_bad_images_are_refused_naming_the_part() -> None:
    assert "not valid base64" in refusal("data:image/png;base64,@@@").message
    assert "cannot be decoded" in refusal(data_url(b"not an image at all")).message
    assert "must be base64" in refusal("data:image/png,rawbytes").message
    assert "image/gif" in refusal(data_url(b"GIF89a", "image/gif")).message
    gif = io.BytesIO()
    Image.new("RGB", (4, 4)).save(gif, format="GIF")
    assert "GIF images are not supported" in refusal(data_url(gif.getvalue())).message
    small = MediaConfig(max_image_pixels=100)
    assert "at most 100 pixels" in refusal(data_url(encoded()), small).message
    tiny = MediaConfig(max_image_bytes=10)
    assert "at most 10 are allowed" in refusal(data_url(encoded()), tiny).message
    assert "data:, file:// or http(s)://" in refusal("ftp://example.com/cat.png").message


def test_remote_urls_are_off_unless_enabled() -> None:
    assert "media.allow_remote_urls" in refusal("https://example.com/cat.png").message


def test_local_files_only_under_the_allowed_folder(tmp_path: Path) -> None:
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(encoded())
    (tmp_path / "secret.png").write_bytes(encoded())
    assert "media.allowed_local_media_path" in refusal(f"file://{allowed}/cat.png").message
    config = MediaConfig(allowed_local_media_path=str(allowed))
    assert load(f"file://{allowed}/cat.png", config).image.size == (40, 30)
    assert "under" in refusal(f"file://{allowed}/../secret.png", config).message
    assert "no file" in refusal(f"file://{allowed}/dog.png", config).message


def chat(*parts: dict[str, Any]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": list(parts)}]}
    )


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def test_audio_and_video_parts_are_refused_by_name() -> None:
    for kind in ("input_audio", "video_url"):
        with pytest.raises(ValidationError) as info:
            chat({"type": "text", "text": "hi"}, {"type": kind, kind: {}})
        error = validation_error(info.value.errors())
        assert error.status == 400 and error.param is not None
        assert error.param.startswith("messages.0.content")
        assert f"{kind!r} are not supported" in error.message


TINY_VISION = parse_model_config(checkpoint_config("nemotron_vl")).vision
assert TINY_VISION is not None and TINY_VISION.image_token_id == 6
SUPPORT = ImageSupport(
    vision=TINY_VISION,
    processing=ImageProcessorConfig(min_num_patches=4, max_num_patches=64),
    placeholder="<image>",
)


def test_chat_images_become_placeholder_text_and_placed_inputs() -> None:
    body = chat(
        {"type": "text", "text": "compare"},
        image_part(data_url(encoded(size=(64, 64)))),
        image_part(data_url(encoded("WEBP", size=(64, 64)))),
    )
    images = asyncio.run(load_chat_images(body, SUPPORT, MediaConfig()))
    assert images.texts == ["<img>" + "<image>" * 4 + "</img>"] * 2
    # The same pixels in another (lossless) file format are the same image.
    assert images.inputs[0].content_hash == images.inputs[1].content_hash
    assert body.template_messages(images.texts)[0]["content"].startswith("compare<img>")
    prompt = [1, 2, 50, 6, 6, 6, 6, 51, 50, 6, 6, 6, 6, 51, 3]
    placed = place_images(prompt, images.inputs, image_token_id=6)
    assert [(i.offset, i.num_tokens) for i in placed] == [(3, 4), (9, 4)]
    with pytest.raises(APIError, match="image placeholder token"):
        place_images(prompt[:-2] + [6, 3], images.inputs, image_token_id=6)


def test_tiled_images_take_every_tiles_placeholders() -> None:
    """VL V2 tiles: a 128 x 64 image is 2 x 1 tiles of 64 px plus a thumbnail,
    4 tokens each; a 64 x 64 one is a single tile with no thumbnail."""
    tiles = ImageProcessorConfig(tile_size=64, max_num_tiles=4)
    support = ImageSupport(vision=TINY_VISION, processing=tiles, placeholder="<image>")
    body = chat(
        image_part(data_url(encoded(size=(128, 64)))), image_part(data_url(encoded(size=(64, 64))))
    )
    images = asyncio.run(load_chat_images(body, support, MediaConfig()))
    assert [(i.grid_hw, i.num_tokens) for i in images.inputs] == [((4, 8), 12), ((4, 4), 4)]
    assert images.texts[0] == "<img>" + "<image>" * 12 + "</img>"


def test_images_are_refused_for_text_models_and_beyond_the_count_limit() -> None:
    body = chat(image_part(data_url(encoded())), image_part(data_url(encoded())))
    with pytest.raises(APIError, match="takes no images") as info:
        asyncio.run(load_chat_images(body, None, MediaConfig()))
    assert info.value.param == "messages[0].content[0]"
    with pytest.raises(APIError, match="at most 1 per request"):
        asyncio.run(load_chat_images(body, SUPPORT, MediaConfig(max_images_per_request=1)))
