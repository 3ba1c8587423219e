"""Image preprocessing of the Nemotron Omni checkpoints, with Pillow and torch.

Follows transformers' `NemotronH_Omni_Reasoning_V3ImageProcessor` (whose own
code needs torchvision): each image is resized (bicubic, antialiased, in
float32 so the overshoot is kept) to a patch grid close to its own size, with
both sides multiples of the pixel-shuffle `merge_size` and the patch count
within the budget; then normalized by the CLIP mean/std and cut into
row-major patches, each channel-major:

    RGB [3, gh * p, gw * p] -> pixel_values [gh * gw, 3 * p * p]

An image already `gh * p` by `gw * p` pixels is not resized. The prompt holds
`<img>` + `gh * gw / merge_size^2` x `<image>` + `</img>` per image.

Settings come from the checkpoint's `preprocessor_config.json` when it has
one, else from the model's vision config and transformers' defaults.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.config import VisionConfig
from models.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from PIL import Image

PREPROCESSOR_FILE = "preprocessor_config.json"
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGE_START = "<img>"
IMAGE_END = "</img>"


@dataclass(frozen=True)
class ImageProcessorConfig:
    patch_size: int = 16
    downsample_ratio: float = 0.5
    min_num_patches: int = 1024
    max_num_patches: int = 13312  # 0 = no cap
    max_model_len: int = 16384
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD

    @property
    def merge_size(self) -> int:
        return round(1 / self.downsample_ratio)

    def patch_budget(self, num_images: int) -> int:
        """Patches each image of a call of `num_images` may take: the context
        length (in pre-shuffle patches), clamped to the min/max settings."""
        budget = max(
            (self.max_model_len - 4) * self.merge_size**2, self.min_num_patches * num_images
        )
        if self.max_num_patches:
            budget = min(budget, self.max_num_patches)
        return max(budget, self.min_num_patches)

    def patch_grid(self, height: int, width: int, num_images: int = 1) -> tuple[int, int]:
        """`(gh, gw)` the image is resized to (transformers' `get_patch_grid_size`)."""
        return patch_grid(
            height,
            width,
            self.patch_size,
            self.merge_size,
            self.min_num_patches,
            self.patch_budget(num_images),
        )


def patch_grid(
    height: int, width: int, patch_size: int, merge: int, min_patches: int, max_patches: int
) -> tuple[int, int]:
    """The image's own grid, scaled into `[min_patches, max_patches]`, then each
    side rounded to a multiple of `merge` (up if that stays in budget, else down)."""
    # Literally transformers' `round(x + 0.5)`: floor(x) + 1 for a fractional x,
    # and for a whole x, x or x + 1 by round-half-to-even.
    rows = round(height / patch_size + 0.5)
    cols = round(width / patch_size + 0.5)
    factor = min(math.sqrt(max_patches / (rows * cols)), 1.0)
    # At least one patch per side: transformers divides by zero on images whose
    # short side would round to nothing (a 1 x 3000 strip under a small budget).
    rows, cols = max(1, math.floor(factor * rows)), max(1, math.floor(factor * cols))
    if max_patches > min_patches and rows * cols < min_patches:
        factor = math.sqrt(min_patches / (rows * cols))
        rows, cols = math.ceil(factor * rows), math.ceil(factor * cols)
    if remainder := rows % merge:
        if (rows + merge - remainder) * cols <= max_patches:
            rows += merge - remainder
        else:
            rows = max(merge, rows - remainder)
    if remainder := cols % merge:
        if rows * (cols + merge - remainder) <= max_patches:
            cols += merge - remainder
        else:
            cols = max(merge, cols - remainder)
    return rows, cols


def load_image_processor_config(checkpoint_dir: Path, vision: VisionConfig) -> ImageProcessorConfig:
    """Settings from `<checkpoint_dir>/preprocessor_config.json`, else the defaults
    with the tower's patch size and the model's downsample ratio."""
    path = Path(checkpoint_dir) / PREPROCESSOR_FILE
    raw: dict[str, Any] = {}
    if path.is_file():
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    defaults = ImageProcessorConfig()
    config = ImageProcessorConfig(
        patch_size=int(raw.get("patch_size", vision.patch_size)),
        downsample_ratio=float(raw.get("downsample_ratio", vision.downsample_ratio)),
        min_num_patches=int(raw.get("min_num_patches", defaults.min_num_patches)),
        max_num_patches=int(raw.get("max_num_patches", defaults.max_num_patches)),
        max_model_len=int(raw.get("max_model_len", defaults.max_model_len)),
        image_mean=tuple(raw.get("image_mean", raw.get("norm_mean", OPENAI_CLIP_MEAN))),
        image_std=tuple(raw.get("image_std", raw.get("norm_std", OPENAI_CLIP_STD))),
    )
    if config.patch_size != vision.patch_size:
        raise ConfigError(
            f"{path}: patch_size {config.patch_size} differs from the vision tower's "
            f"{vision.patch_size}"
        )
    return config


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (as transformers does)."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def preprocess_image(
    image: Image.Image, grid_hw: tuple[int, int], config: ImageProcessorConfig
) -> torch.Tensor:
    """`pixel_values [gh * gw, 3 * p * p]` (float32) of `image` resized to `grid_hw`."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    p = config.patch_size
    rgb = np.asarray(to_rgb(image), dtype=np.uint8)
    pixels = torch.from_numpy(rgb.copy()).permute(2, 0, 1).to(torch.float32)
    size = (grid_hw[0] * p, grid_hw[1] * p)
    if tuple(pixels.shape[1:]) != size:
        pixels = F.interpolate(
            pixels[None], size=size, mode="bicubic", align_corners=False, antialias=True
        )[0]
    # Rescale by 1/255 and normalize in one step, as transformers fuses them.
    mean = torch.tensor(config.image_mean, dtype=torch.float32).view(-1, 1, 1) * 255.0
    std = torch.tensor(config.image_std, dtype=torch.float32).view(-1, 1, 1) * 255.0
    pixels = (pixels - mean) / std
    channels = pixels.shape[0]
    patches = pixels.reshape(channels, grid_hw[0], p, grid_hw[1], p).permute(1, 3, 0, 2, 4)
    return patches.reshape(grid_hw[0] * grid_hw[1], channels * p * p).contiguous()


def image_prompt_text(num_tokens: int, image_token: str) -> str:
    """The prompt text standing for one image of `num_tokens` embeddings."""
    return IMAGE_START + image_token * num_tokens + IMAGE_END
