"""Nemotron-H: a hybrid decoder of Mamba2, attention, MLP and MoE layers.

Every layer is the same pre-norm residual block, `x + mixer(norm(x))`, whose
mixer is chosen by `config.layer_types[i]` (the checkpoint's pattern letter):

    "mamba"     M  Mamba2 mixer, state in a Mamba slot      (models/layers/mamba2.py)
    "attention" *  GQA attention over the paged KV cache, no positional encoding
    "mlp"       -  relu² MLP                                 (models/layers/relu2_mlp.py)
    "moe"       E  routed relu² experts + shared expert      (models/layers/moe.py)

Attention carries no RoPE: transformers' `NemotronHAttention` applies none
(the Mamba layers order the tokens), so `batch.positions` is unused here.

The layers themselves live in `models/nemotron_h_block.py`; with
`config.use_mtp` the model also owns the multi-token-prediction layers
(`models/nemotron_h_mtp.py`), run by `mtp_forward`.

Module names follow the checkpoint: `backbone.embeddings`,
`backbone.layers.N.{norm,mixer.*}`, `backbone.norm_f`, `lm_head`, `mtp.layers.N.*`.
Per-expert tensors stay per expert (`mixer.experts.N.{up,down}_proj.weight`),
as on disk. Also accepted when loading: transformers' in-memory prefix
`model.` for `backbone.`. Without `use_mtp` the MTP tensors (`mtp.*`) are
skipped, as transformers skips them; with it they are loaded and required.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from kvcache.views import CacheViews
from models.base import CausalLM
from models.batch import ForwardBatch
from models.config import ATTENTION, MAMBA, MLP, MOE, ModelConfig
from models.errors import ConfigError
from models.layers.fused_linear import FusedLinear
from models.layers.mamba2 import Mamba2Mixer
from models.layers.norm import RMSNorm
from models.layers.relu2_mlp import Relu2MLP
from models.layers.vocab_parallel import VocabParallelEmbedding
from models.nemotron_h_block import HYBRID_LAYER_KINDS, NemotronHAttention, NemotronHBlock
from models.nemotron_h_mtp import MTP_PREFIX, NemotronHMTP, check_mtp_config
from models.sharding import vocab_rows_per_rank
from models.tensor_parallel import gather_vocab


class NemotronHBackbone(nn.Module):
    """Embedding, the hybrid layers and the final norm (checkpoint prefix `backbone.`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, config.tp)
        seen = {kind: 0 for kind in HYBRID_LAYER_KINDS}
        blocks = []
        for kind in config.layer_types:
            blocks.append(NemotronHBlock(config, kind, seen[kind]))
            seen[kind] += 1
        self.layers = nn.ModuleList(blocks)
        self.norm_f = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch, caches: CacheViews) -> torch.Tensor:
        hidden = batch.input_embeddings(self.embeddings)
        for block in self.layers:
            hidden = block(hidden, batch, caches)
        return self.norm_f(hidden)


class NemotronHForCausalLM(CausalLM):
    """Nemotron-H over the paged KV cache and the Mamba slot pool.

    Prefers the V2 block-major cache manager (attention blocks and Mamba slots
    each one contiguous region) and the Python transceiver (hybrid layouts are
    moved as per-(layer, block) and per-slot segments).
    """

    preferred_kv_manager: ClassVar[str | None] = "v2"
    preferred_transceiver: ClassVar[str | None] = "python"
    supports_tensor_parallel: ClassVar[bool] = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        _check_config(config)
        self.backbone = NemotronHBackbone(config)
        # Never shared with the embedding: transformers' Nemotron-H keeps (and
        # saves) its own lm_head even under tie_word_embeddings; see load_weights.
        # This rank's vocab rows (all of them with one rank).
        rows = vocab_rows_per_rank(config.vocab_size, config.tp.size)
        self.lm_head = nn.Linear(config.hidden_size, rows, bias=False)
        # The MTP shares the embedding and lm_head above; it has none of its own.
        self.mtp = NemotronHMTP(config) if config.use_mtp else None
        # Cache views: the backbone's attention layers, then the MTP's.
        self.num_attention_layers = len(config.layers_of(ATTENTION)) + len(
            config.mtp_attention_layers()
        )
        self.num_mamba_layers = len(config.layers_of(MAMBA))
        self.logits_head: FusedLinear | None = None

    @property
    def has_mtp(self) -> bool:
        """Whether the model was built with its MTP layers (`config.use_mtp`)."""
        return self.mtp is not None

    def forward(self, batch: ForwardBatch, caches: CacheViews) -> torch.Tensor:
        self._check_caches(caches)
        return self.backbone(batch, caches)

    def mtp_forward(
        self,
        input_ids: torch.Tensor,
        target_hidden: torch.Tensor,
        batch: ForwardBatch,
        caches: CacheViews,
    ) -> torch.Tensor:
        """The MTP layers' hidden states `[T, hidden]` (turned into draft logits
        by `compute_logits`, and the next chained step's `target_hidden`).

        Row t predicts the token after `input_ids[t]`: `input_ids[t]` is the
        token at `batch.positions[t] + 1` and `target_hidden[t]` the hidden
        state `forward` (or the previous MTP step) returned at
        `batch.positions[t]`. The MTP attention K/V is written at
        `batch.positions` through `batch.slot_mapping`.
        """
        if self.mtp is None:
            raise ValueError(
                f"{type(self).__name__} was built without its MTP layers; build it from "
                "a config with use_mtp (models.loader.load_model(..., use_mtp=True))"
            )
        self._check_caches(caches)
        embeds = self.backbone.embeddings(input_ids)
        return self.mtp(embeds, target_hidden, batch, caches)

    def _check_caches(self, caches: CacheViews) -> None:
        if (len(caches.attention), len(caches.mamba)) != (
            self.num_attention_layers,
            self.num_mamba_layers,
        ):
            raise ValueError(
                f"expected {self.num_attention_layers} attention and {self.num_mamba_layers} "
                f"mamba cache views, got {len(caches.attention)} and {len(caches.mamba)}"
            )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits_head is not None and self.logits_head.is_current():
            logits = self.logits_head(hidden)
        else:
            logits = self.lm_head(hidden)
        return gather_vocab(logits, self.config.tp, self.config.vocab_size)

    def process_weights_after_loading(self) -> None:
        """Prepack the backbone's Mamba, attention and MLP projections and the
        head (see `FusedLinear`)."""
        self.logits_head = FusedLinear([self.lm_head])
        for block in self.backbone.layers:
            if isinstance(block.mixer, Mamba2Mixer | NemotronHAttention | Relu2MLP):
                block.mixer.fuse_projections()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load by checkpoint name; with `tie_word_embeddings` and no `lm_head.weight`
        on disk, the head is a copy of the embedding."""
        if self.config.tie_word_embeddings:
            weights = self._with_tied_head(weights)
        super().load_weights(weights)

    def _with_tied_head(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        embedding, has_head = None, False
        for disk_name, tensor in weights:
            name = self.checkpoint_name(disk_name)
            has_head |= name == "lm_head.weight"
            if name == "backbone.embeddings.weight":
                embedding = tensor
            yield disk_name, tensor
        if embedding is not None and not has_head:
            yield "lm_head.weight", embedding

    def checkpoint_name(self, disk_name: str) -> str | None:
        if disk_name.startswith(MTP_PREFIX):
            return disk_name if self.mtp is not None else None
        if disk_name.startswith("model."):
            return "backbone." + disk_name.removeprefix("model.")
        return disk_name


def _check_config(config: ModelConfig) -> None:
    if config.use_mtp:
        check_mtp_config(config)
    unknown = sorted(set(config.layer_types) - set(HYBRID_LAYER_KINDS))
    if unknown:
        raise ConfigError(
            f"{config.architecture}: Nemotron-H layers must be {list(HYBRID_LAYER_KINDS)}, "
            f"got {unknown}"
        )
    kinds = config.layer_types + (config.mtp_layer_types if config.use_mtp else ())
    uses_relu2 = MLP in kinds or MOE in kinds
    if uses_relu2 and config.hidden_act != "relu2":
        raise ConfigError(
            f"{config.architecture}: mlp_hidden_act is {config.hidden_act!r}; "
            "Nemotron-H MLP and MoE layers support only 'relu2'"
        )
