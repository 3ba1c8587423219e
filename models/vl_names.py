"""Tensor names of the VL / Omni image path in its two on-disk layouts.

Released checkpoints (and transformers' `save_pretrained`, which converts back
to them) use the RADIO release names; transformers' Omni class names the same
tensors differently in memory:

    release (on disk)                                   transformers
    vision_model.radio_model.model.patch_generator.embedder  vision_model.embeddings.patch_projection
    ...patch_generator.pos_embed                        vision_model.embeddings.position_embedding
    ...patch_generator.cls_token.token                  vision_model.embeddings.cls_register_token
    ...blocks.N.attn.qkv  (q | k | v on dim 0)          vision_model.encoder.layer.N.attention.{q,k,v}_proj
    ...blocks.N.attn.proj                               ...attention.o_proj
    mlp1.{0,1,3}                                        multi_modal_projector.{layer_norm,linear_1,linear_2}
    vision_projector.vision_final_layernorm             vision_final_layernorm

`release_name` maps a transformers name to the release one (with which third
of a fused qkv tensor it is); the embedded-checkpoint writer and the model
loader share it.
"""

from __future__ import annotations

import re

RADIO_PREFIX = "vision_model.radio_model.model."
# Release-name prefixes of the image path: vision tower, its final norm, projector.
IMAGE_PATH_PREFIXES = ("vision_model.", "mlp1.", "vision_projector.")
_RELEASE_TOWER = "vision_model.radio_model."

# Transformers -> release, applied in order as substring renames: the longer
# `video_patch_projection` must be renamed before `patch_projection`.
_RADIO_RENAMES: tuple[tuple[str, str], ...] = (
    ("embeddings.video_patch_projection", "radio_model.model.patch_generator.video_embedder"),
    ("embeddings.patch_projection", "radio_model.model.patch_generator.embedder"),
    ("embeddings.position_embedding", "radio_model.model.patch_generator.pos_embed"),
    ("embeddings.cls_register_token", "radio_model.model.patch_generator.cls_token.token"),
    ("encoder.layer.", "radio_model.model.blocks."),
    ("attention.o_proj", "attn.proj"),
    ("input_conditioner", "radio_model.input_conditioner"),
    ("summary_idxs", "radio_model.summary_idxs"),
)
_PROJECTOR_RENAMES: tuple[tuple[str, str], ...] = (
    ("multi_modal_projector.layer_norm.", "mlp1.0."),
    ("multi_modal_projector.linear_1.", "mlp1.1."),
    ("multi_modal_projector.linear_2.", "mlp1.3."),
    ("vision_final_layernorm.", "vision_projector.vision_final_layernorm."),
)
_QKV = re.compile(r"(?P<stem>.*)\.attention\.(?P<part>q|k|v)_proj\.(?P<kind>weight|bias)")
QKV_PARTS = ("q", "k", "v")


def release_name(name: str) -> tuple[str, int | None]:
    """`(release name, qkv part)`: part 0/1/2 for a q/k/v projection tensor,
    which is that third of the release's fused `attn.qkv`; None otherwise.
    Release names (and names of neither layout) come back unchanged."""
    if name.startswith(_RELEASE_TOWER) or not name.startswith("vision_model."):
        return _renamed(name, _PROJECTOR_RENAMES), None
    match = _QKV.fullmatch(name)
    if match is not None:
        stem = _radio_name(match["stem"])
        return f"{stem}.attn.qkv.{match['kind']}", QKV_PARTS.index(match["part"])
    return _radio_name(name), None


def _radio_name(name: str) -> str:
    rest = name.removeprefix("vision_model.")
    for old, new in _RADIO_RENAMES:
        rest = rest.replace(old, new, 1)
    return "vision_model." + rest


def _renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def is_image_path(name: str) -> bool:
    """Whether tensor `name` (either layout) belongs to the image path."""
    return release_name(name)[0].startswith(IMAGE_PATH_PREFIXES)
