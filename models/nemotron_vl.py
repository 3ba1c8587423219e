"""The Nemotron-H VL / Omni checkpoints: a Nemotron-H language model with an image path.

One class serves the three wrapper architectures (`NemotronH_Nano_VL_V2`,
`NemotronH_Nano_Omni_Reasoning_V3`, `NemotronH_Omni_Reasoning_V3`). It
*composes* a `NemotronHForCausalLM` (attribute `language_model`, as in the
checkpoint) rather than inheriting from it. With a `vision_config` it also
builds the image path of transformers' `NemotronH_Omni_Reasoning_V3`:

    pixel_values [gh * gw, 3 * p * p] -> RADIO tower (models/radio.py)
      -> optional final LayerNorm -> pixel shuffle by `merge_size`
      -> projector mlp1 (RMSNorm, Linear, ReLU^2, Linear)
      -> [gh * gw / merge_size^2, text hidden]: one row per `<image>` token

`encode_image` runs that path for one image; the engine puts its rows into
`ForwardBatch.image_embeds` and the backbone uses them in place of the
placeholder tokens' embeddings. Audio and video towers are not built.

Under tensor parallelism the backbone is sharded like a Nemotron-H and the
image path runs on rank 0 alone, whole: it is small beside the backbone and
runs once per image (later chunks and requests hit the engine's encoder
cache, which lives on rank 0), so splitting it would add collectives to
every tower layer for little gain, and replicating it would store and run it
N times. The other ranks neither load nor build it; rank 0 broadcasts the
step's image rows' embeddings (`[rows, hidden]`) to them before the backbone
runs.

Everything that depends on the hybrid layer pattern comes from the backbone
class: the `auto` preferences are copied from it at class level (the outer
pretrained config holds the pattern one level down, so nothing reads it here),
and `ModelConfig` already describes the nested language model.

Checkpoint names: `language_model.backbone.*` / `language_model.lm_head.weight`
go to the backbone, and so do the multi-token-prediction layers
`language_model.mtp.*` (loaded with `config.use_mtp`, skipped without; the
wrapper's `mtp_forward` runs them); the image path loads from the release names or
transformers' (see `models/vl_names.py`); the audio tensors (`sound_encoder.*`,
`sound_projection.*`, `audio_tower.*`, `embed_audio.*`), video patch embedder,
input conditioner and summary indices are skipped. Any other name is reported
as unexpected.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kvcache.views import CacheViews
from models.base import CausalLM
from models.batch import ForwardBatch
from models.config import ModelConfig
from models.errors import CheckpointError
from models.layers.norm import RMSNorm
from models.nemotron_h import NemotronHForCausalLM
from models.radio import RadioVisionTower
from models.tensor_parallel import broadcast_from_first_rank
from models.vl_names import IMAGE_PATH_PREFIXES, RADIO_PREFIX, release_name

LANGUAGE_MODEL_PREFIX = "language_model."
SKIPPED_PREFIXES = (
    "sound_encoder.",
    "sound_projection.",
    "audio_tower.",
    "embed_audio.",
    RADIO_PREFIX + "patch_generator.video_embedder.",
    "vision_model.radio_model.input_conditioner.",
    "vision_model.radio_model.summary_idxs",
)


class ReLUSquared(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.square(F.relu(x))


def pixel_shuffle(features: torch.Tensor, ratio: float) -> torch.Tensor:
    """`[1, gh, gw, C]` -> `[1, gh * r, gw * r, C / r^2]` as transformers' Omni
    model does it: each output position gathers a `1/r x 1/r` patch square."""
    _, rows, cols, channels = features.shape
    x = features.view(1, rows, int(cols * ratio), int(channels / ratio))
    x = x.transpose(1, 2).contiguous()
    x = x.view(1, int(cols * ratio), int(rows * ratio), int(channels / ratio**2))
    return x.transpose(1, 2).contiguous()


class NemotronVLForCausalLM(CausalLM):
    """A Nemotron-H VL / Omni checkpoint around a composed backbone."""

    backbone_class: ClassVar[type[NemotronHForCausalLM]] = NemotronHForCausalLM
    preferred_kv_manager: ClassVar[str | None] = NemotronHForCausalLM.preferred_kv_manager
    preferred_transceiver: ClassVar[str | None] = NemotronHForCausalLM.preferred_transceiver
    supports_tensor_parallel: ClassVar[bool] = NemotronHForCausalLM.supports_tensor_parallel

    def __init__(self, config: ModelConfig) -> None:
        """`config` describes the nested language model; `config.vision` the image path."""
        super().__init__(config)
        self.language_model = self.backbone_class(config)
        self.vision = config.vision
        if config.vision is not None:
            v = config.vision
            self.vision_model = RadioVisionTower(v)
            self.vision_final_layernorm = (
                nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps) if v.final_layernorm else None
            )
            shuffled = v.hidden_size * v.merge_size**2
            self.mlp1 = nn.Sequential(
                RMSNorm(shuffled, eps=1e-5),
                nn.Linear(shuffled, v.projector_hidden_size, bias=False),
                ReLUSquared(),
                nn.Linear(v.projector_hidden_size, config.hidden_size, bias=False),
            )

    def forward(self, batch: ForwardBatch, caches: CacheViews) -> torch.Tensor:
        tp = self.config.tp
        if tp.size > 1 and batch.image_rows is not None:
            # Rank 0 ran the image path; every rank needs its rows' embeddings.
            table = self.language_model.backbone.embeddings.weight
            shape = (batch.image_rows.shape[0], self.config.hidden_size)
            batch.image_embeds = broadcast_from_first_rank(batch.image_embeds, shape, table, tp)
        return self.language_model(batch, caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    @property
    def has_mtp(self) -> bool:
        """Whether the language model was built with its MTP layers."""
        return self.language_model.has_mtp

    def mtp_forward(
        self,
        input_ids: torch.Tensor,
        target_hidden: torch.Tensor,
        batch: ForwardBatch,
        caches: CacheViews,
    ) -> torch.Tensor:
        """The language model's MTP hidden states (`NemotronHForCausalLM.mtp_forward`)."""
        return self.language_model.mtp_forward(input_ids, target_hidden, batch, caches)

    def encode_image(self, pixel_values: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
        """Embeddings `[num_image_tokens, hidden]` of one preprocessed image."""
        v = self.vision
        if v is None:
            raise ValueError(f"{self.config.architecture} checkpoint has no vision_config")
        dtype = self.vision_model.patch_generator.embedder.weight.dtype
        features = self.vision_model(pixel_values.to(dtype), grid_hw)
        if self.vision_final_layernorm is not None:
            features = self.vision_final_layernorm(features)
        shuffled = pixel_shuffle(features.view(1, *grid_hw, -1), v.downsample_ratio)
        return self.mlp1(shuffled.flatten(0, 2))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hand `language_model.*` tensors to the backbone, load the image path.

        Raises `CheckpointError` naming tensors under no known prefix, missing
        or mis-shaped image-path tensors, together with whatever the backbone
        reports (missing, unexpected, mis-shaped).
        """
        unknown: list[str] = []
        problems: list[str] = []
        image_path = _ImagePathLoader(self) if self.vision is not None else None
        try:
            self.language_model.load_weights(
                self._language_model_weights(weights, unknown, image_path)
            )
        except CheckpointError as exc:
            problems.append(f"under {LANGUAGE_MODEL_PREFIX!r}: {exc}")
        if image_path is not None:
            problems.extend(image_path.problems())
        if unknown:
            problems.append(
                f"tensors outside the language model and the known non-text prefixes: "
                f"{', '.join(sorted(unknown)[:20])}"
                + (f" (+{len(unknown) - 20} more)" if len(unknown) > 20 else "")
            )
        if problems:
            raise CheckpointError(f"{type(self).__name__}: " + "; ".join(problems))

    def process_weights_after_loading(self) -> None:
        self.language_model.process_weights_after_loading()

    @staticmethod
    def _language_model_weights(
        weights: Iterable[tuple[str, torch.Tensor]],
        unknown: list[str],
        image_path: _ImagePathLoader | None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.startswith(LANGUAGE_MODEL_PREFIX):
                yield name.removeprefix(LANGUAGE_MODEL_PREFIX), tensor
                continue
            disk_name, part = release_name(name)
            if disk_name.startswith(SKIPPED_PREFIXES):
                continue
            if not disk_name.startswith(IMAGE_PATH_PREFIXES):
                unknown.append(name)
            elif image_path is not None:
                image_path.load(name, disk_name, part, tensor)


class _ImagePathLoader:
    """Copies release-named image-path tensors into the wrapper's parameters."""

    def __init__(self, model: NemotronVLForCausalLM) -> None:
        self.params = {
            name: param
            for name, param in model.named_parameters()
            if not name.startswith(LANGUAGE_MODEL_PREFIX)
        }
        self.seen: set[str] = set()
        self.unexpected: list[str] = []
        self.mismatched: list[str] = []

    def load(self, name: str, disk_name: str, part: int | None, tensor: torch.Tensor) -> None:
        target = _parameter_name(disk_name)
        param = self.params.get(target)
        if param is None:
            self.unexpected.append(name)
            return
        rows = param.shape[0] // 3
        dest = param if part is None else param[part * rows : (part + 1) * rows]
        if tuple(tensor.shape) != tuple(dest.shape):
            self.mismatched.append(
                f"{name}: expected {tuple(dest.shape)}, found {tuple(tensor.shape)}"
            )
            return
        with torch.no_grad():
            dest.copy_(tensor.to(dtype=param.dtype))
        self.seen.update(_pieces(target) if part is None else [f"{target}#{part}"])

    def problems(self) -> list[str]:
        expected = {
            piece
            for name in self.params
            if not name.endswith(RadioVisionTower.OPTIONAL_SUFFIXES)
            for piece in _pieces(name)
        }
        missing = sorted(expected - self.seen)
        found = []
        for label, names in (
            ("image-path tensors missing", missing),
            ("unexpected image-path tensors", self.unexpected),
            ("image-path shape mismatches", self.mismatched),
        ):
            if names:
                found.append(f"{label}: {', '.join(names[:20])}")
        return found


def _pieces(name: str) -> list[str]:
    """What loading `name` whole covers: a fused qkv tensor is three pieces, since
    transformers' layout loads it a third at a time."""
    return [f"{name}#{part}" for part in range(3)] if ".attn.qkv." in name else [name]


def _parameter_name(disk_name: str) -> str:
    """Release name -> the wrapper's parameter name."""
    if disk_name.startswith(RADIO_PREFIX):
        return "vision_model." + disk_name.removeprefix(RADIO_PREFIX)
    return disk_name.replace("vision_projector.vision_final_layernorm.", "vision_final_layernorm.")
