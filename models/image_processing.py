"""Image preprocessing of the Nemotron VL / Omni checkpoints, with Pillow and torch.

Two formats. The Omni format (dynamic resolution) follows transformers'
`NemotronH_Omni_Reasoning_V3ImageProcessor` (whose own code needs
torchvision): each image is resized (bicubic, antialiased, in
float32 so the overshoot is kept) to a patch grid close to its own size, with
both sides multiples of the pixel-shuffle `merge_size` and the patch count
within the budget; then normalized by the CLIP mean/std and cut into
row-major patches, each channel-major:

    RGB [3, gh * p, gw * p] -> pixel_values [gh * gw, 3 * p * p]

An image already `gh * p` by `gw * p` pixels is not resized. The prompt holds
`<img>` + `gh * gw / merge_size^2` x `<image>` + `</img>` per image.

The released VL V2 format (`tile_size` set) resizes the image to whole square
tiles instead (`models.image_tiling`); its patch grid is that of the resized
image, and the pixels are cut into tiles (plus a thumbnail) before the
patches, each tile encoded on its own.

Settings come from the checkpoint's `preprocessor_config.json` when it has
one (`NemotronNanoVLV2ImageProcessor`, or `image_size` with `max_num_tiles` /
`use_thumbnail`, selects tiles, with that processor's defaults 512 / 12 /
thumbnail on), else from the model's vision config and transformers' defaults.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.config import VisionConfig
from models.errors import ConfigError
from models.image_tiling import num_tiles, tile_arrangement

if TYPE_CHECKING:
    import torch
    from PIL import Image

PREPROCESSOR_FILE = "preprocessor_config.json"
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGE_START = "<img>"
IMAGE_END = "</img>"
# The released VL V2 checkpoints' image processor: tiles, 512 px unless its
# config says otherwise.
VL_V2_PROCESSOR = "NemotronNanoVLV2ImageProcessor"
VL_V2_TILE_SIZE = 512


@dataclass(frozen=True)
class ImageProcessorConfig:
    patch_size: int = 16
    downsample_ratio: float = 0.5
    min_num_patches: int = 1024
    max_num_patches: int = 13312  # 0 = no cap
    max_model_len: int = 16384
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    # The VL V2 tiling format when > 0: tiles of this many pixels a side.
    tile_size: int = 0
    max_num_tiles: int = 12
    use_thumbnail: bool = True

    @property
    def merge_size(self) -> int:
        return round(1 / self.downsample_ratio)

    @property
    def tile_patches(self) -> int:
        """Patches along a tile's side (tiling format)."""
        return self.tile_size // self.patch_size

    def encoder_grids(self, grid_hw: tuple[int, int]) -> list[tuple[int, int]]:
        """The patch grids the vision tower encodes, in prompt order, for an
        image of patch grid `grid_hw`: the image itself, or each of its tiles."""
        if not self.tile_size:
            return [grid_hw]
        t = self.tile_patches
        count = num_tiles(grid_hw[0] // t, grid_hw[1] // t, self.use_thumbnail)
        return [(t, t)] * count

    def num_image_tokens(self, grid_hw: tuple[int, int]) -> int:
        """Placeholder tokens (= embeddings) of an image of patch grid `grid_hw`."""
        return sum(rows * cols for rows, cols in self.encoder_grids(grid_hw)) // self.merge_size**2

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
        """`(gh, gw)` the image is resized to (transformers' `get_patch_grid_size`;
        whole tiles in the tiling format, whatever the number of images)."""
        if self.tile_size:
            rows, cols = tile_arrangement(height, width, self.tile_size, self.max_num_tiles)
            return rows * self.tile_patches, cols * self.tile_patches
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
        tile_size=int(raw.get("image_size", VL_V2_TILE_SIZE)) if _is_tiled(raw) else 0,
        max_num_tiles=int(raw.get("max_num_tiles", defaults.max_num_tiles)),
        use_thumbnail=bool(raw.get("use_thumbnail", defaults.use_thumbnail)),
    )
    if config.patch_size != vision.patch_size:
        raise ConfigError(
            f"{path}: patch_size {config.patch_size} differs from the vision tower's "
            f"{vision.patch_size}"
        )
    _check_tiles(config, path)
    return config


def _is_tiled(raw: dict[str, Any]) -> bool:
    """The VL V2 tiling format: its processor's name, or a tile size with a
    tile count or thumbnail setting."""
    if raw.get("image_processor_type") == VL_V2_PROCESSOR:
        return True
    return "image_size" in raw and ("max_num_tiles" in raw or "use_thumbnail" in raw)


def _check_tiles(config: ImageProcessorConfig, path: Path) -> None:
    if not config.tile_size:
        return
    side = config.patch_size * config.merge_size
    if config.tile_size % side:
        raise ConfigError(
            f"{path}: image_size {config.tile_size} must be a multiple of patch_size x "
            f"(1 / downsample_ratio) = {side}, so every tile gives whole embeddings"
        )
    if config.max_num_tiles < 1:
        raise ConfigError(f"{path}: max_num_tiles must be at least 1, got {config.max_num_tiles}")


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
    """`pixel_values [gh * gw, 3 * p * p]` (float32) of `image` resized to `grid_hw`,
    or in the tiling format, the patches of each tile in turn (the thumbnail's
    last): `[sum of the encoder grids' patches, 3 * p * p]`."""
    import numpy as np
    import torch

    rgb = np.asarray(to_rgb(image), dtype=np.uint8)
    pixels = torch.from_numpy(rgb.copy()).permute(2, 0, 1).to(torch.float32)
    p = config.patch_size
    resized = _normalize(_resize(pixels, (grid_hw[0] * p, grid_hw[1] * p)), config)
    if not config.tile_size:
        return _patches(resized, p)
    s = config.tile_size
    channels = resized.shape[0]
    rows, cols = grid_hw[0] // config.tile_patches, grid_hw[1] // config.tile_patches
    tiles = resized.reshape(channels, rows, s, cols, s).permute(1, 3, 0, 2, 4)
    pieces = list(tiles.reshape(rows * cols, channels, s, s))
    if len(config.encoder_grids(grid_hw)) > len(pieces):
        pieces.append(_normalize(_resize(pixels, (s, s)), config))
    return torch.cat([_patches(piece, p) for piece in pieces])


def _resize(pixels: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """`[3, H, W]` float pixels at `size` (bicubic, antialiased, overshoot kept)."""
    import torch.nn.functional as F

    if tuple(pixels.shape[1:]) == size:
        return pixels
    return F.interpolate(
        pixels[None], size=size, mode="bicubic", align_corners=False, antialias=True
    )[0]


def _normalize(pixels: torch.Tensor, config: ImageProcessorConfig) -> torch.Tensor:
    import torch

    # Rescale by 1/255 and normalize in one step, as transformers fuses them.
    mean = torch.tensor(config.image_mean, dtype=torch.float32).view(-1, 1, 1) * 255.0
    std = torch.tensor(config.image_std, dtype=torch.float32).view(-1, 1, 1) * 255.0
    return (pixels - mean) / std


def _patches(pixels: torch.Tensor, p: int) -> torch.Tensor:
    """`[3, gh * p, gw * p]` -> row-major patches `[gh * gw, 3 * p * p]`, channel-major."""
    channels, height, width = pixels.shape
    gh, gw = height // p, width // p
    patches = pixels.reshape(channels, gh, p, gw, p).permute(1, 3, 0, 2, 4)
    return patches.reshape(gh * gw, channels * p * p).contiguous()


def image_prompt_text(num_tokens: int, image_token: str) -> str:
    """The prompt text standing for one image of `num_tokens` embeddings."""
    return IMAGE_START + image_token * num_tokens + IMAGE_END
