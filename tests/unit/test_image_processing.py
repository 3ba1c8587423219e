"""models.image_processing against transformers' Omni image processor semantics.

transformers' processor module imports torchvision, which is not installed
here, so its two pure functions (`get_patch_grid_size`,
`convert_image_to_patches`) are compiled from that file's own source and used
as the reference; resizing is checked against hand computations.
"""

from __future__ import annotations

import ast
import inspect
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from models.image_processing import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ImageProcessorConfig,
    image_prompt_text,
    load_image_processor_config,
    preprocess_image,
    to_rgb,
)

OMNI_PROCESSOR = (
    Path(inspect.getfile(transformers)).parent
    / "models/nemotron_h_omni/image_processing_nemotron_h_omni.py"
)


def transformers_function(name: str) -> Callable[..., Any]:
    tree = ast.parse(OMNI_PROCESSOR.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace: dict[str, Any] = {"math": math, "torch": torch}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(OMNI_PROCESSOR), "exec"), namespace)
    return namespace[name]  # type: ignore[no-any-return]


@pytest.mark.parametrize("budget", [(4, 64), (1024, 13312), (16, 16)])
def test_patch_grid_matches_transformers(budget: tuple[int, int]) -> None:
    reference = transformers_function("get_patch_grid_size")
    min_patches, max_patches = budget
    config = ImageProcessorConfig(min_num_patches=min_patches, max_num_patches=max_patches)
    for height in (1, 15, 16, 17, 48, 64, 100, 333, 1000, 4000):
        for width in (1, 16, 31, 64, 80, 250, 777, 3000):
            rows, cols = config.patch_grid(height, width)
            assert rows % 2 == 0 and cols % 2 == 0
            try:
                expected = reference(height, width, 16, 2, min_patches, max_patches)
            except ZeroDivisionError:  # transformers fails on extreme strips; we do not
                continue
            if 0 in expected:  # nor do we return an empty grid
                continue
            assert (rows, cols) == expected, (height, width)


def test_budget_follows_context_length_and_image_count() -> None:
    config = ImageProcessorConfig(min_num_patches=4, max_num_patches=0, max_model_len=10)
    assert config.patch_budget(1) == (10 - 4) * 4
    assert config.patch_budget(9) == 4 * 9


def random_image(height: int, width: int, mode: str = "RGB") -> Image.Image:
    gen = torch.Generator().manual_seed(height * 1000 + width)
    channels = len(mode)
    pixels = torch.randint(0, 256, (height, width, channels), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.squeeze(-1).numpy(), mode=mode)


def normalized(pixels_chw: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(OPENAI_CLIP_MEAN).view(3, 1, 1)
    std = torch.tensor(OPENAI_CLIP_STD).view(3, 1, 1)
    return (pixels_chw / 255.0 - mean) / std


def test_exact_size_image_is_only_normalized_and_patched() -> None:
    image = random_image(32, 48)
    config = ImageProcessorConfig()
    ours = preprocess_image(image, (2, 3), config)
    pixels = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)
    expected = transformers_function("convert_image_to_patches")(
        normalized(pixels.float())[None], 16
    )
    assert ours.shape == (6, 3 * 16 * 16)
    torch.testing.assert_close(ours, expected[0], rtol=0, atol=1e-5)


def test_resized_uniform_image_keeps_its_colour() -> None:
    """A one-colour image stays that colour through the bicubic resize, so every
    patch holds the normalized colour."""
    colour = (200, 30, 90)
    image = Image.new("RGB", (50, 70), colour)
    ours = preprocess_image(image, (4, 2), ImageProcessorConfig())
    assert ours.shape == (8, 3 * 16 * 16)
    expected = normalized(torch.tensor(colour, dtype=torch.float32).view(3, 1, 1)).view(3)
    per_channel = ours.view(8, 3, 256)
    torch.testing.assert_close(
        per_channel, expected.view(1, 3, 1).expand_as(per_channel), rtol=0, atol=1e-4
    )


def test_downscale_by_two_averages_like_an_antialiased_bicubic() -> None:
    """Halving a 2-pixel checkerboard: the antialiased resize blends each pixel
    pair toward their mean instead of sampling one of them."""
    board = torch.zeros(64, 64, 3, dtype=torch.uint8)
    board[::2, ::2] = 255
    board[1::2, 1::2] = 255
    ours = preprocess_image(Image.fromarray(board.numpy()), (2, 2), ImageProcessorConfig())
    grey = normalized(torch.full((3, 1, 1), 127.5)).view(3)
    centre = ours.view(2, 2, 3, 16, 16)[:, :, :, 4:12, 4:12]
    torch.testing.assert_close(centre.mean(dim=(0, 1, 3, 4)), grey, rtol=0, atol=0.05)


def test_transparency_is_composited_on_white() -> None:
    clear = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    assert to_rgb(clear).getpixel((0, 0)) == (255, 255, 255)
    opaque = Image.new("RGBA", (4, 4), (10, 20, 30, 255))
    assert to_rgb(opaque).getpixel((0, 0)) == (10, 20, 30)
    assert to_rgb(Image.new("L", (2, 2), 7)).getpixel((0, 0)) == (7, 7, 7)


def test_prompt_text_wraps_the_placeholders() -> None:
    assert image_prompt_text(3, "<image>") == "<img><image><image><image></img>"


def test_config_file_overrides_defaults(tmp_path: Path) -> None:
    from models.embedded.configs import checkpoint_config
    from models.hf_config import parse_model_config

    vision = parse_model_config(checkpoint_config("nemotron_vl")).vision
    assert vision is not None and vision.patch_size == 16
    assert load_image_processor_config(tmp_path, vision) == ImageProcessorConfig()
    (tmp_path / "preprocessor_config.json").write_text(
        '{"min_num_patches": 4, "max_num_patches": 64, "norm_mean": [0.5, 0.5, 0.5]}'
    )
    config = load_image_processor_config(tmp_path, vision)
    assert (config.min_num_patches, config.max_num_patches) == (4, 64)
    assert config.image_mean == (0.5, 0.5, 0.5)
    assert config.image_std == OPENAI_CLIP_STD
