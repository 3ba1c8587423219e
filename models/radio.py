"""The RADIO vision tower of the Nemotron VL / Omni checkpoints.

A C-RADIO ViT: each image's patches are projected, given a position embedding
cropped (and interpolated) from a square table to the image's patch grid, and
preceded by learned cls + register tokens; pre-norm transformer blocks with
bidirectional attention run over one image at a time. The output is the patch
tokens' features, prefix tokens dropped:

    pixel_values [gh * gw, C * p * p]  (row-major patches, channel-major inside)
      -> embedder + pos_embed[:gh, :gw] -> [prefix | patches]
      -> blocks -> patches' rows          [gh * gw, hidden]

Pixel values arrive normalized (CLIP mean/std applied by the image
preprocessing), so the checkpoint's input conditioner is not run.

Module names follow the released checkpoints below
`vision_model.radio_model.model.` (`patch_generator.embedder`,
`blocks.N.attn.qkv`, ...).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import VisionConfig
from models.layers.attention import sdpa


class ClsToken(nn.Module):
    """The learned prefix (cls + register) tokens, `[num_prefix_tokens, hidden]`."""

    def __init__(self, num_tokens: int, hidden_size: int) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.zeros(num_tokens, hidden_size))


class PatchGenerator(nn.Module):
    """Patch projection, cropped position embedding and prefix tokens."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.max_grid = config.max_img_size // config.patch_size
        self.embedder = nn.Linear(config.patch_dim, config.hidden_size, bias=False)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.max_grid**2, config.hidden_size))
        self.cls_token = ClsToken(config.num_prefix_tokens, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
        patches = self.embedder(pixel_values) + self.position_embedding(grid_hw, pixel_values.dtype)
        return torch.cat([self.cls_token.token, patches])

    def position_embedding(self, grid_hw: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """`[gh * gw, hidden]`: the table resized to a square of the longer side,
        cropped to the grid, and resized again only if the crop falls short."""
        table = self.pos_embed.reshape(1, self.max_grid, self.max_grid, -1).permute(0, 3, 1, 2)
        side = max(grid_hw)
        pos = F.interpolate(table.float(), size=(side, side), mode="bilinear", align_corners=False)
        pos = pos[..., : grid_hw[0], : grid_hw[1]]
        if tuple(pos.shape[-2:]) != grid_hw:
            pos = F.interpolate(pos, size=grid_hw, mode="bilinear", align_corners=False)
        return pos.to(dtype).flatten(2)[0].transpose(0, 1)


class RadioAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.qkv_bias)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, hidden = x.shape
        q, k, v = self.qkv(x).view(tokens, 3, self.num_heads, -1).permute(1, 2, 0, 3)
        out = sdpa(q, k, v)  # bidirectional within the image
        return self.proj(out.transpose(0, 1).reshape(tokens, hidden))


class RadioMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        inner = int(config.hidden_size * config.mlp_ratio)
        self.fc1 = nn.Linear(config.hidden_size, inner)
        self.fc2 = nn.Linear(inner, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class LayerScale(nn.Module):
    """Per-channel scale; C-RADIO has none, so it stays 1 unless a checkpoint sets it."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.lambda1 = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.lambda1


class RadioBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = RadioAttention(config)
        self.layer_scale1 = LayerScale(config.hidden_size)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = RadioMLP(config)
        self.layer_scale2 = LayerScale(config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.layer_scale1(self.attn(self.norm1(x)))
        return x + self.layer_scale2(self.mlp(self.norm2(x)))


class RadioVisionTower(nn.Module):
    """Patch features of one image: `[gh * gw, C * p * p]` -> `[gh * gw, hidden]`."""

    # Parameters a checkpoint may leave out (C-RADIO releases have no layer scale).
    OPTIONAL_SUFFIXES = ("layer_scale1.lambda1", "layer_scale2.lambda1")

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_prefix_tokens = config.num_prefix_tokens
        self.patch_generator = PatchGenerator(config)
        self.blocks = nn.ModuleList(RadioBlock(config) for _ in range(config.num_layers))

    def forward(self, pixel_values: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
        if pixel_values.shape[0] != grid_hw[0] * grid_hw[1]:
            raise ValueError(
                f"{pixel_values.shape[0]} patches do not fill a {grid_hw[0]}x{grid_hw[1]} grid"
            )
        x = self.patch_generator(pixel_values, grid_hw)
        for block in self.blocks:
            x = block(x)
        return x[self.num_prefix_tokens :]
