"""The Nemotron-H VL / Omni checkpoints, served through their language model.

One class serves the three wrapper architectures (`NemotronH_Nano_VL_V2`,
`NemotronH_Nano_Omni_Reasoning_V3`, `NemotronH_Omni_Reasoning_V3`). It
*composes* a `NemotronHForCausalLM` (attribute `language_model`, as in the
checkpoint) rather than inheriting from it, and runs the text path only: token
ids in, logits out; no vision or audio tower is built or run.

Everything that depends on the hybrid layer pattern comes from the backbone
class: the `auto` preferences are copied from it at class level (the outer
pretrained config holds the pattern one level down, so nothing reads it here),
and `ModelConfig` already describes the nested language model.

Checkpoint names (as transformers' `NemotronH_Omni_Reasoning_V3` saves them,
and as the released VL checkpoints store them):

    language_model.backbone.*, language_model.lm_head.weight  -> the backbone
    vision_model.*, mlp1.*, vision_projector.*, sound_encoder.*,
    sound_projection.* (and transformers' renamed multi_modal_projector.*,
    vision_final_layernorm.*, audio_tower.*, embed_audio.*)     -> ignored

Any other name is reported as unexpected.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch

from kvcache.views import CacheViews
from models.base import CausalLM
from models.batch import ForwardBatch
from models.config import ModelConfig
from models.errors import CheckpointError
from models.nemotron_h import NemotronHForCausalLM

LANGUAGE_MODEL_PREFIX = "language_model."
NON_TEXT_PREFIXES = (
    "vision_model.",
    "mlp1.",
    "vision_projector.",
    "sound_encoder.",
    "sound_projection.",
    "multi_modal_projector.",
    "vision_final_layernorm.",
    "audio_tower.",
    "embed_audio.",
)


class NemotronVLForCausalLM(CausalLM):
    """Text path of a Nemotron-H VL / Omni checkpoint around a composed backbone."""

    backbone_class: ClassVar[type[NemotronHForCausalLM]] = NemotronHForCausalLM
    preferred_kv_manager: ClassVar[str | None] = NemotronHForCausalLM.preferred_kv_manager
    preferred_transceiver: ClassVar[str | None] = NemotronHForCausalLM.preferred_transceiver

    def __init__(self, config: ModelConfig) -> None:
        """`config` describes the nested language model (`llm_config`/`text_config`)."""
        super().__init__(config)
        self.language_model = self.backbone_class(config)

    def forward(self, batch: ForwardBatch, caches: CacheViews) -> torch.Tensor:
        return self.language_model(batch, caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hand `language_model.*` tensors to the backbone, skip the non-text towers.

        Raises `CheckpointError` naming tensors under no known prefix, together
        with whatever the backbone reports (missing, unexpected, mis-shaped).
        """
        unknown: list[str] = []
        problems: list[str] = []
        try:
            self.language_model.load_weights(self._language_model_weights(weights, unknown))
        except CheckpointError as exc:
            problems.append(f"under {LANGUAGE_MODEL_PREFIX!r}: {exc}")
        if unknown:
            problems.append(
                f"tensors outside the language model and the known non-text prefixes: "
                f"{', '.join(sorted(unknown)[:20])}"
                + (f" (+{len(unknown) - 20} more)" if len(unknown) > 20 else "")
            )
        if problems:
            raise CheckpointError(f"{type(self).__name__}: " + "; ".join(problems))

    @staticmethod
    def _language_model_weights(
        weights: Iterable[tuple[str, torch.Tensor]], unknown: list[str]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.startswith(LANGUAGE_MODEL_PREFIX):
                yield name.removeprefix(LANGUAGE_MODEL_PREFIX), tensor
            elif not name.startswith(NON_TEXT_PREFIXES):
                unknown.append(name)
