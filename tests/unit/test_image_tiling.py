"""The VL V2 tiling format: tile choice, tiles + thumbnail pixels, and the
model on such pixels against transformers' Omni class (fp32).

The tile choice and the pixels are checked against hand computations; the
encoder is checked by giving transformers the same tiles as separate images
(its tower encodes each one alone, as the tiling format does) in front of a
prompt whose one `<img> ... </img>` span holds every tile's placeholders.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from engine.image_encoder import ImageEncoder
from engine.multimodal import ImageInput
from models.embedded.configs import IMAGE_TOKEN_ID
from models.embedded.writer import write_checkpoint
from models.image_processing import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ImageProcessorConfig,
    load_image_processor_config,
    preprocess_image,
)
from models.image_tiling import num_tiles, tile_arrangement
from models.loader import load_model
from models.nemotron_vl import NemotronVLForCausalLM
from tests.paged_harness import assert_matches_reference, run_paged_generation

TILES = ImageProcessorConfig(tile_size=64, max_num_tiles=4, use_thumbnail=True)


@pytest.mark.parametrize(
    ("height", "width", "max_tiles", "expected"),
    [
        (448, 448, 12, (1, 1)),
        (500, 1000, 12, (1, 2)),  # aspect 2: 2 x 1 (4 x 2 ties, but the image is small)
        (1000, 2000, 12, (2, 4)),  # the same aspect, over half of 8 tiles' pixels
        (1000, 500, 12, (2, 1)),
        (300, 1000, 12, (1, 3)),  # 3.33: 3 x 1 beats 4 x 1
        (100, 1000, 12, (1, 10)),
        (100, 1000, 4, (1, 4)),
        (700, 1000, 12, (2, 3)),  # 1.43: 3 x 2 (1.5) is closest
    ],
)
def test_tile_arrangement_is_the_closest_aspect_ratio(
    height: int, width: int, max_tiles: int, expected: tuple[int, int]
) -> None:
    assert tile_arrangement(height, width, 448, max_tiles) == expected


def test_thumbnail_follows_only_a_multi_tile_image() -> None:
    assert (num_tiles(1, 1, True), num_tiles(1, 2, True), num_tiles(1, 2, False)) == (1, 3, 2)
    assert TILES.patch_grid(30, 100) == (4, 12)  # 1 x 3 tiles of 4 x 4 patches
    assert TILES.encoder_grids((4, 12)) == [(4, 4)] * 4
    assert TILES.num_image_tokens((4, 12)) == 16  # 4 tiles x 4 tokens
    assert TILES.num_image_tokens((4, 4)) == 4  # one tile, no thumbnail


def normalized(colour: tuple[int, int, int]) -> torch.Tensor:
    rgb = torch.tensor(colour, dtype=torch.float32)
    return (rgb / 255.0 - torch.tensor(OPENAI_CLIP_MEAN)) / torch.tensor(OPENAI_CLIP_STD)


def test_exact_size_image_is_cut_into_tiles_then_a_thumbnail() -> None:
    """A 128 x 64 image is two tiles already (no resize): the left one red,
    the right one blue; the thumbnail is the whole image at 64 x 64, red on
    its left side and blue on its right away from the seam."""
    red, blue = (220, 10, 10), (10, 10, 220)
    image = Image.new("RGB", (128, 64), red)
    image.paste(blue, (64, 0, 128, 64))
    grid = TILES.patch_grid(64, 128)
    assert grid == (4, 8)
    pixels = preprocess_image(image, grid, TILES)
    assert pixels.shape == (3 * 16, 3 * 16 * 16)
    # [tile, patch row, patch col, channel, y, x] back to tile images [tile, 3, 64, 64]
    tiles = pixels.view(3, 4, 4, 3, 16, 16).permute(0, 3, 1, 4, 2, 5).reshape(3, 3, 64, 64)
    for tile, colour in ((0, red), (1, blue)):
        expected = normalized(colour).view(3, 1, 1).expand(3, 64, 64)
        torch.testing.assert_close(tiles[tile], expected, rtol=0, atol=1e-5)
    thumb = tiles[2]
    # An antialiased bicubic halving reads 2 source pixels either side per
    # output pixel, so only the columns next to the seam (32) blend.
    torch.testing.assert_close(
        thumb[:, :, :29], normalized(red).view(3, 1, 1).expand(3, 64, 29), rtol=0, atol=1e-4
    )
    torch.testing.assert_close(
        thumb[:, :, 35:], normalized(blue).view(3, 1, 1).expand(3, 64, 29), rtol=0, atol=1e-4
    )


def test_resized_uniform_image_keeps_its_colour_in_every_tile() -> None:
    colour = (40, 180, 90)
    grid = TILES.patch_grid(70, 150)  # aspect 2.14: 2 x 1 tiles
    assert grid == (4, 8)
    pixels = preprocess_image(Image.new("RGB", (150, 70), colour), grid, TILES)
    per_channel = pixels.view(-1, 3, 256)
    expected = normalized(colour).view(1, 3, 1).expand_as(per_channel)
    torch.testing.assert_close(per_channel, expected, rtol=0, atol=1e-4)


def test_config_file_selects_tiles(tmp_path: Path) -> None:
    from models.embedded.configs import checkpoint_config, image_processor_config
    from models.hf_config import parse_model_config

    vision = parse_model_config(checkpoint_config("nemotron_vl")).vision
    assert vision is not None
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps(image_processor_config("tiny", "tiles")))
    config = load_image_processor_config(tmp_path, vision)
    assert (config.tile_size, config.max_num_tiles, config.use_thumbnail) == (64, 4, True)
    # The released processor's name alone means its defaults.
    path.write_text(json.dumps({"image_processor_type": "NemotronNanoVLV2ImageProcessor"}))
    config = load_image_processor_config(tmp_path, vision)
    assert (config.tile_size, config.max_num_tiles, config.use_thumbnail) == (512, 12, True)
    path.write_text(json.dumps({"image_size": 72, "max_num_tiles": 4}))
    with pytest.raises(ValueError, match="multiple of patch_size"):
        load_image_processor_config(tmp_path, vision)


@pytest.fixture(scope="module")
def tiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(
        tmp_path_factory.mktemp("tiled"),
        "nemotron_vl",
        vl_architecture="NemotronH_Omni_Reasoning_V3",
        initializer_range=0.1,
        image_format="tiles",
    )


def png_of(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_tiled_image_matches_transformers_on_the_same_tiles(tiled: Path) -> None:
    """Encoder output and the model's logits and greedy tokens for a prompt
    with one tiled image (2 x 1 tiles + thumbnail), as transformers' Omni
    model given those three tiles."""
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    model, config = load_model(tiled)
    assert isinstance(model, NemotronVLForCausalLM) and config.vision is not None
    processing = load_image_processor_config(tiled, config.vision)
    noise = torch.randint(0, 256, (60, 130, 3), generator=torch.Generator().manual_seed(1))
    image = Image.fromarray(noise.byte().numpy())
    grid = processing.patch_grid(image.height, image.width)
    grids = processing.encoder_grids(grid)
    assert len(grids) == 3
    num_tokens = processing.num_image_tokens(grid)
    data = png_of(image)
    encoder = ImageEncoder(model, processing, torch.device("cpu"))
    embeds = encoder.embeddings(
        ImageInput(hashlib.sha256(data).digest(), data, grid, 3, num_tokens)
    )
    pixel_values = preprocess_image(image, grid, processing)
    reference = NemotronH_Omni_Reasoning_V3.from_pretrained(tiled, dtype=torch.float32).eval()
    grid_hw = torch.tensor(grids)
    with torch.no_grad():
        expected = reference.get_image_features(pixel_values, grid_hw).pooler_output
    torch.testing.assert_close(embeds, torch.cat(list(expected)), rtol=0, atol=1e-5)

    prompt = [40, 41, 42] + [IMAGE_TOKEN_ID] * num_tokens + [43, 44, 45, 46]
    embeds_at = dict(zip(range(3, 3 + num_tokens), embeds, strict=True))
    steps = 8
    spec = config.cache_spec()
    trace = run_paged_generation(
        model, spec, [prompt], chunk_size=5, decode_steps=steps, embeds_at=[embeds_at]
    )
    assert_matches_reference(
        reference,
        [prompt],
        trace,
        steps,
        reference_inputs=[{"pixel_values": pixel_values, "image_grid_hw": grid_hw}],
    )
